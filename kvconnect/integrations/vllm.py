"""vLLM adapter: our connectors behind vLLM's KVConnectorBase_V1 (the only module importing vLLM).

Three connector names are registered with vLLM's KVConnectorFactory (see `register`):

- ``KVConnectNixl`` / ``KVConnectMooncake``: P/D disaggregation (pull mode) on `kvconnect.connector`,
  moving blocks with NIXL or Mooncake. kv_transfer_params follow vLLM's P/D convention
  (do_remote_decode, do_remote_prefill, remote_block_ids, remote_engine_id, remote_request_id,
  remote_host, remote_port) so existing routers work unchanged.
- ``KVConnectOffload``: a host-memory KV tier (`kvconnect.offload`), on CPU and CUDA alike.

vLLM builds two instances per engine: one in the scheduler process (role SCHEDULER) and one per
worker (role WORKER); they share no memory. Scheduler -> worker travels in `_Meta` (built every
step by `build_connector_meta`), worker -> scheduler in vLLM's KVConnectorOutput and, once at start,
in the handshake metadata (the worker's side-channel address, engine id and incarnation).

How a P/D request goes:
  prefill scheduler: a request with ``do_remote_decode`` is tracked; in the step that computes the
  end of its prompt, the metadata tells the worker to hold its blocks; the worker holds them under a
  lease right after that forward pass (`wait_for_save`), before the engine can return the request.
  `request_finished` then keeps the blocks (returns True) and hands out the transfer params. The
  worker reports the request in finished_sending once the consumer is done, aborted, or the lease
  expired; only then does vLLM free the blocks.
  decode scheduler: ``do_remote_prefill`` -> the prompt's tokens are an asynchronous external hit;
  after allocation the metadata tells the worker which local blocks to pull into. The worker's
  consumer pulls on its own thread; a finished or failed load is reported in finished_recving (and
  failed_recving), and vLLM applies kv_load_failure_policy (fail: the request errors; recompute: it
  is prefilled locally).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
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

from kvconnect import metrics, wire
from kvconnect.connector import ConnectorConfig, KVConnector
from kvconnect.errors import KVConnectError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvconnect.vllm")

NAMES = {
    "KVConnectNixl": "KVConnectNixl",
    "KVConnectMooncake": "KVConnectMooncake",
    "KVConnectOffload": "KVConnectOffload",
}

_registered = False
_register_lock = threading.Lock()


def register() -> None:
    """Register our connector names with vLLM's KVConnectorFactory; a second call is a no-op."""
    global _registered
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with _register_lock:
        if _registered:
            return
        for name, cls in NAMES.items():
            if name in KVConnectorFactory._registry:  # registered by another plugin load in this process
                continue
            try:
                KVConnectorFactory.register_connector(name, __name__, cls)
            except ValueError:  # raced with another registration: already there is what we want
                pass
        _registered = True


# --------------------------------------------------------------------------------------------------
# configuration

_PD_KEYS = {
    "host": str, "port": int, "advertise_host": str, "allow_wildcard": bool, "secret": str,
    "lease_s": (int, float), "load_timeout_s": (int, float), "handshake_timeout_s": (int, float),
    "heartbeat_s": (int, float), "transport_options": dict, "load_deadline_s": (int, float),
    "stats_path": str,
}
_OFFLOAD_KEYS = {"cpu_bytes": int, "cpu_gib": (int, float), "policy": str, "stats_path": str, "salt": str,
                 "timeout_s": (int, float)}
_ROLE = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}


def _extra(vllm_config: "VllmConfig", allowed: dict[str, Any], connector: str) -> dict[str, Any]:
    """kv_connector_extra_config, checked: unknown keys and wrong types are errors naming the key."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        raise ValueError(f"{connector}: unknown kv_connector_extra_config key(s) {unknown}; "
                         f"allowed: {sorted(allowed)}")
    for key, value in extra.items():
        types = allowed[key]
        if isinstance(value, bool) and types is not bool and bool not in (types if isinstance(types, tuple) else ()):
            raise ValueError(f"{connector}: kv_connector_extra_config[{key!r}] must be {types}, got {value!r}")
        if not isinstance(value, types):
            raise ValueError(f"{connector}: kv_connector_extra_config[{key!r}] must be "
                             f"{getattr(types, '__name__', types)}, got {type(value).__name__} {value!r}")
        if key.endswith("_s") and value <= 0:
            raise ValueError(f"{connector}: kv_connector_extra_config[{key!r}] must be positive, got {value!r}")
    return extra


def _check_groups(kv_cache_config: "KVCacheConfig | None", connector: str) -> list[list[str]]:
    """Layer names per KV-cache group; refuses what our core cannot move yet (Mamba state pages)."""
    if kv_cache_config is None:
        return []
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if "Mamba" in kind or not hasattr(spec, "num_kv_heads"):
            raise ValueError(
                f"{connector} does not support KV-cache group of {kind} yet (hybrid attention + Mamba "
                "models): kvconnect's vLLM adapter moves attention KV pages only. Use a non-hybrid model.")
        groups.append(list(g.layer_names))
    return groups


def _block_size(vllm_config: "VllmConfig") -> int:
    return int(vllm_config.cache_config.block_size)


# --------------------------------------------------------------------------------------------------
# scheduler <-> worker messages


@dataclass
class KVConnectHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once: where the worker's producer side channel listens."""

    engine_id: str
    host: str
    port: int
    incarnation: str


@dataclass
class _Meta(KVConnectorMetadata):
    # P/D
    holds: list[tuple[str, list[list[int]], int]] = field(default_factory=list)  # request, ids per group, tokens
    loads: list[tuple[str, list[list[int]], dict]] = field(default_factory=list)  # request, local ids, params
    releases: list[tuple[str, dict]] = field(default_factory=list)  # full local hit: pull nothing, free remote
    aborts: list[str] = field(default_factory=list)
    # offload
    offload_loads: list[tuple[list[int], list[int]]] = field(default_factory=list)  # block ids, slots
    offload_stores: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # request, ids, slots


@dataclass
class KVConnectStats(KVConnectorStats):
    """Transfer counters a worker reports each step (summed)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _params_to_vllm(p: wire.TransferParams) -> dict[str, Any]:
    """Our TransferParams as vLLM's P/D kv_transfer_params (the decode side's request params)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": p.block_ids[0] if len(p.block_ids) == 1 else p.block_ids,
        "remote_engine_id": p.engine_id,
        "remote_request_id": p.request_id,
        "remote_host": p.host,
        "remote_port": p.port,
        "remote_num_tokens": p.num_tokens,
        "remote_incarnation": p.incarnation,
        "remote_lease_expiry": p.lease_expiry,
        "tp_size": 1,
    }


def _params_from_vllm(d: dict[str, Any]) -> wire.TransferParams:
    """vLLM P/D kv_transfer_params (as a router forwards them) back to our TransferParams."""
    missing = [k for k in ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                           "remote_port", "remote_incarnation") if k not in d]
    if missing:
        raise KVConnectError(f"kv_transfer_params lack {missing} (were they produced by a kvconnect prefill?)")
    ids = d["remote_block_ids"]
    groups = ids if ids and isinstance(ids[0], (list, tuple)) else [ids]
    return wire.transfer_params_from_builtins({
        "engine_id": d["remote_engine_id"], "host": d["remote_host"], "port": int(d["remote_port"]),
        "request_id": d["remote_request_id"], "block_ids": [list(map(int, g)) for g in groups],
        "num_tokens": int(d.get("remote_num_tokens") or 0),
        "lease_expiry": float(d.get("remote_lease_expiry") or time.time() + 30.0),
        "incarnation": d["remote_incarnation"],
    })


# --------------------------------------------------------------------------------------------------
# P/D


class _PDConnector(KVConnectorBase_V1, SupportsHMA):
    """P/D disaggregation on kvconnect's KVConnector; subclasses set `backend`."""

    backend = ""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        name = type(self).__name__
        ktc = vllm_config.kv_transfer_config
        self._extra = _extra(vllm_config, _PD_KEYS, name)
        if ktc.kv_role not in _ROLE:
            raise ValueError(f"{name}: kv_role must be one of {sorted(_ROLE)}, got {ktc.kv_role!r}")
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        if tp > 1:
            # Transfer params name one side channel and one rank's blocks: with TP every decode rank
            # would pull rank 0's shard. Refuse rather than move the wrong bytes.
            raise ValueError(f"{name}: tensor_parallel_size={tp} is not supported yet; run one instance per "
                             "device (tensor_parallel_size=1) and scale out with more instances")
        self._groups = _check_groups(kv_cache_config, name)
        self._block_size = _block_size(vllm_config)
        self._engine_id = str(ktc.engine_id)
        self._kv_role = _ROLE[ktc.kv_role]
        self._lease_s = float(self._extra.get("lease_s", 30.0))
        if role == KVConnectorRole.SCHEDULER:
            self._peer: KVConnectHandshake | None = None
            self._tracked: dict[str, Request] = {}  # do_remote_decode requests not yet held
            self._held: dict[str, tuple[list[list[int]], int, float]] = {}  # ids, tokens, hold time
            self._meta = _Meta()
            self._loading: set[str] = set()
            self._sending: dict[str, int] = {}  # request -> blocks vLLM keeps for it until finished_sending
            self._counters = {"handed_out": 0, "released": 0}
            self._last_stats: dict | None = None
        else:
            self._core: KVConnector | None = None
            self._abandoned: set[str] = set()  # held, but vLLM freed the blocks itself: never report
            self._release_only: set[str] = set()  # loads that pull nothing: never report to vLLM
            self._failed_now: dict[str, str] = {}
            self._local_id: dict[str, str] = {}  # producer's request id -> vLLM's id of the load
            self._stats = KVConnectStats()
            self._metrics_seen: dict[str, float] = {}

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_block_ids") is not None:
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            self._tracked[request.request_id] = request
        elif params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # one transfer per request
            if num_external_tokens > 0:
                local = [list(g) for g in blocks.get_unhashed_block_ids_all_groups()]
                self._meta.loads.append((request.request_id, local, dict(params)))
                self._loading.add(request.request_id)
            elif params.get("remote_block_ids") is not None:
                # A full local prefix hit: nothing to pull, but the producer must free its blocks.
                self._meta.releases.append((request.request_id, dict(params)))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._meta = self._meta, _Meta()
        sched = scheduler_output.num_scheduled_tokens
        for rid, req in list(self._tracked.items()):
            n = sched.get(rid, 0)
            if n and req.num_computed_tokens + n >= req.num_prompt_tokens:
                ntok = req.num_prompt_tokens
                nblk = math.ceil(ntok / self._block_size)
                ids = [list(g[:nblk]) for g in self._kv_cache_manager.get_block_ids(rid)]
                meta.holds.append((rid, ids, ntok))
                self._held[rid] = (ids, ntok, time.time())
                del self._tracked[rid]
        return meta

    def _finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._tracked.pop(rid, None)
        self._loading.discard(rid)
        held = self._held.pop(rid, None)
        if held is None:
            return False, None
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not ok or self._peer is None:
            if self._peer is None:
                log.error("kvconnect: no handshake metadata from the worker; cannot hand out %s", rid)
            self._meta.aborts.append(rid)
            return False, None
        ids, ntok, t0 = held
        self._sending[rid] = sum(len(g) for g in ids)
        self._counters["handed_out"] += 1
        p = wire.TransferParams(engine_id=self._peer.engine_id, host=self._peer.host, port=self._peer.port,
                                request_id=rid, block_ids=ids, num_tokens=ntok,
                                lease_expiry=t0 + self._lease_s, incarnation=self._peer.incarnation)
        return True, _params_to_vllm(p)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        return self._finished(request)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if 0 in metadata:
            self._peer = metadata[0]

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)
        for rid in connector_output.finished_sending or ():
            if self._sending.pop(rid, None) is not None:
                self._counters["released"] += 1
        path = self._extra.get("stats_path")
        if path:
            stats = {**self._counters, "held_requests": len(self._sending),
                     "held_blocks": sum(self._sending.values())}
            if stats != self._last_stats:
                self._last_stats = stats
                tmp = f"{path}.tmp{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(stats, f)
                os.replace(tmp, path)

    def pd_stats(self) -> dict[str, int]:
        """Scheduler side: requests handed out, released, and blocks still held for consumers."""
        return {**self._counters, "held_requests": len(self._sending), "held_blocks": sum(self._sending.values())}

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # ---- worker side ----

    def _config(self) -> ConnectorConfig:
        x = self._extra
        return ConnectorConfig(
            engine_id=self._engine_id, role=self._kv_role, backend=self.backend,
            host=x.get("host", "127.0.0.1"), port=int(x.get("port", 0)), advertise_host=x.get("advertise_host"),
            allow_wildcard=bool(x.get("allow_wildcard", False)), secret=x.get("secret"), lease_s=self._lease_s,
            load_timeout_s=float(x.get("load_timeout_s", x.get("load_deadline_s", 60.0))),
            handshake_timeout_s=float(x.get("handshake_timeout_s", 5.0)),
            heartbeat_s=float(x.get("heartbeat_s", 5.0)), block_size=self._block_size,
            transport_options=dict(x.get("transport_options", {})),
            group_regions=None,
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        cfg = self._config()
        names = list(kv_caches)
        if len(self._groups) > 1:
            # One region per layer, in this order: each group moves its own layers' regions.
            index = {n: i for i, n in enumerate(names)}
            cfg.group_regions = [[index[n] for n in g if n in index] for g in self._groups]
        core = KVConnector(cfg)
        core.register_kv_caches(kv_caches)
        if len(core.regions) != len(names) and cfg.group_regions is not None:
            core.close()
            raise ValueError(f"{type(self).__name__}: KV-cache groups share tensors; not supported yet")
        self._core = core

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._core is None or self._core.producer is None:
            return None
        host, port = self._core.side_channel
        return KVConnectHandshake(engine_id=self._engine_id, host=host, port=port,
                                  incarnation=self._core.metadata.incarnation)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if meta is None or self._core is None:
            return
        for rid in meta.aborts:
            self._abandoned.add(rid)
            self._core.abort(rid)
        # The consumer names a load by the producer's request id (its lease); vLLM by its own id.
        for rid, local, params in meta.loads:
            try:
                p = _params_from_vllm(params)
                self._local_id[p.request_id] = rid
                self._core.start_load(p.request_id, local, p)
            except Exception as exc:  # bad params: the request fails as the policy says
                log.warning("kvconnect: load of %s refused: %s", rid, exc)
                self._failed_now[rid] = str(exc)
        for rid, params in meta.releases:
            try:
                p = _params_from_vllm(params)
                self._local_id[p.request_id] = rid
                self._release_only.add(rid)
                self._core.start_load(p.request_id, [[] for _ in p.block_ids], p)
            except Exception as exc:
                self._release_only.discard(rid)
                log.info("kvconnect: could not release remote blocks of %s: %s", rid, exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        meta = self._connector_metadata
        if meta is None or self._core is None:
            return
        # The forward pass that wrote these prompts' KV is done: hold before vLLM can return them.
        for rid, ids, ntok in meta.holds:
            self._core.request_finished(rid, ids, ntok)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self._core is None:
            return out
        fin = self._core.get_finished()
        for rid in fin.sending:
            if rid in self._abandoned:
                self._abandoned.discard(rid)
            else:
                out.finished_sending.add(rid)
        local = {r: self._local_id.pop(r, r) for r in set(fin.recving) | set(fin.failed)}
        recving = {local[r] for r in fin.recving}
        failed = {local[r]: why for r, why in fin.failed.items()}
        failed.update(self._failed_now)
        self._failed_now = {}
        for rid in recving | set(failed):
            if rid in self._release_only:
                self._release_only.discard(rid)
                continue
            out.finished_recving.add(rid)
            if rid in failed:
                out.failed_recving.add(rid)
        n_ok = len(out.finished_recving) - len(out.failed_recving)
        if n_ok or out.failed_recving or out.finished_sending:
            self._stats.aggregate(KVConnectStats(data={"loads_ok": n_ok, "loads_failed": len(out.failed_recving),
                                                       "sends_done": len(out.finished_sending)}))
        return out

    def get_finished(self, finished_req_ids: set[str]):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failed loads are reported per request (failed_recving): vLLM applies the policy

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role != KVConnectorRole.WORKER:
            return None
        # kvconnect's own Prometheus counters, as increments since the last report, so vLLM's stats
        # carry the same numbers (transfer bytes and seconds, failures by stage, leases...).
        now = {k: v for k, v in metrics.snapshot().items() if "_bucket" not in k}
        delta = {k: v - self._metrics_seen.get(k, 0.0) for k, v in now.items() if v != self._metrics_seen.get(k, 0.0)}
        self._metrics_seen = now
        self._stats.aggregate(KVConnectStats(data=delta))
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVConnectStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVConnectStats(data=dict(data or {}))

    def shutdown(self):
        core = getattr(self, "_core", None)
        if core is not None:
            self._core = None
            core.close()


class KVConnectNixl(_PDConnector):
    """P/D over NIXL (UCX)."""

    backend = "nixl"


class KVConnectMooncake(_PDConnector):
    """P/D over the Mooncake transfer engine."""

    backend = "mooncake"


# --------------------------------------------------------------------------------------------------
# offload


class KVConnectOffload(KVConnectorBase_V1, SupportsHMA):
    """A host-memory KV tier: finished requests' full blocks are stored, prefix hits are loaded back.

    The scheduler owns the tier's bookkeeping (an `OffloadManager`: keys, slots, eviction, pins), the
    worker owns the bytes (a `BlockMover` pool): the scheduler decides, the metadata carries slots.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        name = type(self).__name__
        x = _extra(vllm_config, _OFFLOAD_KEYS, name)
        groups = _check_groups(kv_cache_config, name)
        if len(groups) > 1:
            raise ValueError(f"{name} does not support models with several KV-cache groups (hybrid or "
                             f"sliding-window mixes) yet: this model has {len(groups)}")
        if "cpu_bytes" in x and "cpu_gib" in x:
            raise ValueError(f"{name}: give cpu_bytes or cpu_gib, not both")
        cpu_bytes = int(x["cpu_bytes"]) if "cpu_bytes" in x else int(float(x.get("cpu_gib", 1.0)) * (1 << 30))
        if cpu_bytes <= 0:
            raise ValueError(f"{name}: cpu_bytes must be positive, got {cpu_bytes}")
        self._bs = _block_size(vllm_config)
        self._salt = x.get("salt", "").encode()
        self._timeout_s = float(x.get("timeout_s", 60.0))
        self._stats_path = x.get("stats_path")
        spec_bytes = 0
        for g in kv_cache_config.kv_cache_groups:
            spec_bytes += g.kv_cache_spec.page_size_bytes * len(g.layer_names)
        self._slot_bytes = spec_bytes
        self._num_slots = cpu_bytes // max(spec_bytes, 1)
        if self._num_slots == 0:
            raise ValueError(f"{name}: cpu_bytes={cpu_bytes} cannot hold one block ({spec_bytes} bytes)")
        if role == KVConnectorRole.SCHEDULER:
            from kvconnect.offload.manager import OffloadManager

            self._manager = OffloadManager(self._num_slots, x.get("policy", "lru"), spec_bytes)
            self._keys: dict[str, tuple[int, list[bytes]]] = {}
            self._computed: dict[str, int] = {}
            self._meta = _Meta()
            self._load_batches: list[list] = []  # load plans per built step, unpinned when it reported
            self._stores: dict[str, object] = {}
            self._last_stats: dict | None = None
        else:
            self._mover = None
            self._sent: set[str] = set()
            self._invalid: set[int] = set()
            self._counts = {"blocks_loaded": 0, "blocks_stored": 0}
            self._stats = KVConnectStats()

    # ---- scheduler ----

    def _keys_of(self, request: "Request") -> list[bytes]:
        from kvconnect.offload.keys import block_keys

        tokens = request.prompt_token_ids or []
        got = self._keys.get(request.request_id)
        if got is None or got[0] != len(tokens):
            got = (len(tokens), block_keys(tokens, self._bs, salt=self._salt))
            self._keys[request.request_id] = got
        return got[1]

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        n_prompt = len(request.prompt_token_ids or ())
        if n_prompt < 2 or num_computed_tokens % self._bs:
            return 0, False
        keys = self._keys_of(request)
        limit = min(len(keys), (n_prompt - 1) // self._bs)  # the last prompt token is always computed
        start = num_computed_tokens // self._bs
        hits = 0
        while start + hits < limit and self._manager.contains(keys[start + hits]):
            hits += 1
        self._computed[request.request_id] = num_computed_tokens
        return hits * self._bs, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        keys = self._keys_of(request)
        start = self._computed.get(request.request_id, 0) // self._bs
        nblk = num_external_tokens // self._bs
        ids = blocks.get_block_ids()[0][start:start + nblk]
        self._manager.lookup(keys)  # counted once per admitted request, for the hit/miss stats
        plan = self._manager.prepare_load(keys[start:start + nblk])
        self._meta.offload_loads.append((list(map(int, ids)), plan.slots.tolist()))
        self._pending_loads = getattr(self, "_pending_loads", []) + [plan]

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._meta = self._meta, _Meta()
        self._load_batches.append(getattr(self, "_pending_loads", []))
        self._pending_loads = []
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        if self._load_batches:
            for plan in self._load_batches.pop(0):
                self._manager.complete_load(plan, True)
        for rid in connector_output.finished_sending or ():
            plan = self._stores.pop(rid, None)
            if plan is not None:
                self._manager.complete_store(plan, True)
        self._write_stats()

    def _finished(self, request: "Request", block_ids) -> tuple[bool, dict[str, Any] | None]:
        from kvconnect.offload.keys import block_keys

        rid = request.request_id
        self._keys.pop(rid, None)
        self._computed.pop(rid, None)
        ids = block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids
        ntok = min(request.num_computed_tokens, len(request.all_token_ids))
        keys = block_keys(list(request.all_token_ids[:ntok]), self._bs, salt=self._salt)
        keys = keys[:len(ids)]
        if not keys:
            return False, None
        plan = self._manager.prepare_store(keys)
        if len(plan) == 0:
            return False, None
        src = [int(ids[p]) for p in plan.positions.tolist()]
        self._meta.offload_stores.append((rid, src, plan.slots.tolist()))
        self._stores[rid] = plan
        return True, None

    def request_finished(self, request: "Request", block_ids: list[int]):
        return self._finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        return self._finished(request, block_ids)

    def offload_stats(self) -> dict[str, Any]:
        """The tier's counters (scheduler side): lookups, hits, misses, stores, loads, bytes..."""
        s = self._manager.stats()
        return {f: getattr(s, f) for f in s.__dataclass_fields__}

    def _write_stats(self) -> None:
        if not self._stats_path:
            return
        stats = self.offload_stats()
        if stats == self._last_stats:
            return
        self._last_stats = stats
        tmp = f"{self._stats_path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, self._stats_path)

    # ---- worker ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from kvconnect.offload.mover import BlockMover
        from kvconnect.regions import RegionSet

        regions = RegionSet.from_kv_caches(kv_caches)
        got = sum(r.block_bytes for r in regions)
        if got != self._slot_bytes:
            raise ValueError(f"KVConnectOffload: registered KV caches hold {got} bytes per block, the "
                             f"KV-cache config says {self._slot_bytes}; this layout is not supported")
        self._mover = BlockMover(kv_caches, regions, self._num_slots)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if meta is None or self._mover is None:
            return
        for ids, slots in meta.offload_loads:
            try:
                self._mover.load(np.asarray(slots, dtype=np.int64), np.asarray(ids, dtype=np.int64),
                                 self._mover.engine_event(), self._timeout_s)
                self._counts["blocks_loaded"] += len(ids)
            except Exception as exc:
                log.warning("kvconnect offload: load of %d blocks failed: %s", len(ids), exc)
                self._invalid.update(ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        meta = self._connector_metadata
        if meta is None or self._mover is None:
            return
        for rid, ids, slots in meta.offload_stores:
            try:
                self._mover.store(np.asarray(ids, dtype=np.int64), np.asarray(slots, dtype=np.int64),
                                  self._mover.engine_event(), self._timeout_s)
                self._counts["blocks_stored"] += len(ids)
            except Exception as exc:  # the blocks are only a cache: losing them costs a future miss
                log.warning("kvconnect offload: store for %s failed: %s", rid, exc)
            self._sent.add(rid)

    def get_finished(self, finished_req_ids: set[str]):
        sent, self._sent = self._sent, set()
        return sent or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid = self._invalid, set()
        return bad

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role != KVConnectorRole.WORKER or not any(self._counts.values()):
            return None
        out = KVConnectStats(data=dict(self._counts))
        self._counts = {k: 0 for k in self._counts}
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVConnectStats(data=dict(data or {}))

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def shutdown(self):
        self._mover = None
