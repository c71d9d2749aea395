"""What the worker-side halves of KVConnectNixl and KVConnectMooncake share, whatever the mode.

Builds the kvconnect core, holds blocks right after the forward pass that computed a prompt's end
(`wait_for_save`), aborts before the next one (`start_load_kv`), and reports what ended: sends whose
blocks vLLM may free, loads that finished, loads that failed (in `finished_recving` and
`failed_recving` both, only once nothing can still land in their blocks, so vLLM never reuses a block
under a transfer). What a step starts is the mode's: `pull_worker` (reads) and `push_worker` (offers
and WRITEs); the mode's class is chosen once, when vLLM builds the connector.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvconnect.connector import ConnectorConfig, Finished, KVConnector, KVGroup
from kvconnect.integrations.vllm.config import PDConfig
from kvconnect.integrations.vllm.dump import PageDump
from kvconnect.integrations.vllm.meta import HoldOrder, KVConnectHandshake, KVConnectMeta
from kvconnect.integrations.vllm.stats import KVConnectStats, StepStats
from kvconnect.shards import PageShards

log = logging.getLogger("kvconnect.vllm")


class PDWorkerBase:
    """One engine worker's kvconnect core, driven by the scheduler's per-step instructions."""

    push = False  # whether the core is built with push mode's sides

    def __init__(self, config: PDConfig, *, engine_id: str, role: str, backend: str, block_size: int,
                 layout: str, groups: Sequence[KVGroup], rank: int = 0, world_size: int = 1,
                 shards_of: Callable[[dict[str, torch.Tensor]], dict[str, PageShards]] | None = None):
        self._shards_of = shards_of
        # Each TP rank is one worker with its own side channel: rank r listens on port + r.
        self.core_config = ConnectorConfig(
            engine_id=engine_id, role=role, backend=backend, host=config.host,
            port=config.port + rank if config.port else 0, rank=rank, world_size=world_size,
            advertise_host=config.advertise_host, allow_wildcard=config.allow_wildcard, secret=config.secret,
            lease_s=config.lease_s, load_timeout_s=config.load_timeout_s,
            handshake_timeout_s=config.handshake_timeout_s, heartbeat_s=config.heartbeat_s, block_size=block_size,
            layout=layout, groups=list(groups) or None, transport_options=dict(config.transport_options),
            push=self.push)
        self.core: KVConnector | None = None
        self.device: torch.device | None = None
        self._dump: PageDump | None = None
        self._loading: dict[str, tuple[str, list[list[int]]]] = {}  # handle -> remote name, blocks (dump only)
        self._held: set[str] = set()  # requests this worker holds blocks for
        self._abandoned: set[str] = set()  # held, but vLLM freed the blocks itself: never report as sent
        self._refused: dict[str, str] = {}  # loads refused at start, reported at the next results
        self._stats = StepStats(with_metrics=True)

    # ---- the mode's hooks ----

    def _start_transfers(self, meta: KVConnectMeta) -> None:
        """Before the forward pass: start the step's transfers."""

    def _hold(self, hold: HoldOrder) -> None:
        """The pass computed this prompt: hold its blocks under a lease (pull's hand-over)."""
        self.core.hold_blocks(hold.request_id, hold.block_ids, hold.num_tokens)

    def _pass_ended(self) -> None:
        """After the holds of a forward pass."""

    def _abandons(self, rid: str) -> bool:
        """Whether an abort of a held request means vLLM frees its blocks itself."""
        return rid in self._held

    def _sent(self, fin: Finished) -> list[str]:
        """The requests whose blocks the core gave back."""
        return fin.sending

    # ---- set-up ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the engine's KV tensors with a new core (transport, side channel, consumer)."""
        cfg = self.core_config
        if self._shards_of is not None:
            cfg = self.core_config = dataclasses.replace(cfg, shards=self._shards_of(kv_caches) or None)
        core = KVConnector(cfg)
        core.register_kv_caches(kv_caches)
        self.core = core
        self.device = next(iter(kv_caches.values())).device  # where the engine computes the KV it pushes
        self._dump = PageDump.from_env(kv_caches, cfg.groups or (), cfg.rank if cfg.world_size > 1 else None)

    def handshake(self) -> KVConnectHandshake | None:
        """Where this worker's producer side channel listens (None without a producer side)."""
        if self.core is None or self.core.producer is None:
            return None
        host, port = self.core.side_channel
        return KVConnectHandshake(engine_id=self.core_config.engine_id, host=host, port=port,
                                  incarnation=self.core.metadata.incarnation)

    # ---- per step ----

    def start(self, meta: KVConnectMeta) -> None:
        """Before the forward pass: start this step's transfers, then its aborts."""
        self._start_transfers(meta)
        for rid in meta.aborts:
            log.debug("kvconnect: abort %s", rid)
            if self._abandons(rid):
                self._abandoned.add(rid)
            self.core.abort(rid)

    def after_forward(self, meta: KVConnectMeta) -> None:
        """The forward pass that wrote these prompts' KV is done: hold them before vLLM can return them."""
        for hold in meta.holds:
            log.debug("kvconnect: hold %s", hold.request_id)
            self._hold(hold)
            self._held.add(hold.request_id)
            if self._dump is not None:
                self._dump.write("held", hold.push_key or hold.request_id, hold.block_ids)
        self._pass_ended()

    def layer_saved(self, layer_name: str, meta: KVConnectMeta | None) -> None:
        """The running pass computed this layer's KV (only layer-wise push acts on it)."""

    def results(self) -> KVConnectorTransferResults:
        """Sends whose blocks are free again and loads that ended since the last call."""
        out = KVConnectorTransferResults()
        if self.core is None:
            return out
        fin = self.core.get_finished()
        for rid in self._sent(fin):
            self._held.discard(rid)
            if rid in self._abandoned:
                self._abandoned.discard(rid)
            else:
                out.finished_sending.add(rid)
        if self._dump is not None:
            for handle in fin.loaded:
                self._dump.write("loaded", *self._loading.pop(handle))
            for handle in fin.failed:
                self._loading.pop(handle, None)
        failed = {h: str(f) for h, f in fin.failed.items()}
        failed.update(self._refused)
        self._refused = {}
        out.finished_recving.update(fin.loaded, failed)
        out.failed_recving.update(failed)
        self._stats.add(loads_ok=len(fin.loaded), loads_failed=len(failed), sends_done=len(out.finished_sending))
        return out

    def stats(self) -> KVConnectStats | None:
        """This interval's counters, kvconnect's Prometheus increments included."""
        return self._stats.take()

    def shutdown(self) -> None:
        """Close the core (side channel, consumer, transport)."""
        core, self.core = self.core, None
        if core is not None:
            core.close()


def __getattr__(name: str) -> object:
    if name == "PDWorker":
        raise AttributeError("PDWorker was split by mode: kvconnect.integrations.vllm.pull_worker.PullWorker and "
                             "kvconnect.integrations.vllm.push_worker.PushWorker, over PDWorkerBase")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
