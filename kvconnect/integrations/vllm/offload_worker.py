"""The worker-side half of KVConnectOffload: the host pool and the copies the scheduler planned.

Loads run before the forward pass that reads their blocks; stores after the forward pass that
wrote them. A failed load reports its blocks as invalid (vLLM recomputes them); a failed store only
costs a future miss.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvconnect.integrations.vllm.meta import KVConnectMeta, KVConnectWorkerMeta
from kvconnect.integrations.vllm.stats import KVConnectStats, StepStats
from kvconnect.offload.mover import BlockMover
from kvconnect.regions import RegionSet

log = logging.getLogger("kvconnect.vllm")


class OffloadWorker:
    """Runs one engine worker's tier copies."""

    def __init__(self, *, num_slots: int, slot_bytes: int, timeout_s: float, connector: str):
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.connector = connector
        self._mover: BlockMover | None = None
        self._sent: set[str] = set()
        self._failed_stores: set[str] = set()
        self._invalid: set[int] = set()
        self._stats = StepStats(with_metrics=False)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Allocate the host pool for these caches (one slot holds one block of every region)."""
        regions = RegionSet.from_kv_caches(kv_caches)
        got = sum(r.block_bytes for r in regions)
        if got != self.slot_bytes:
            raise ValueError(f"{self.connector}: registered KV caches hold {got} bytes per block, the KV-cache "
                             f"config says {self.slot_bytes}; this layout is not supported")
        self._mover = BlockMover(kv_caches, regions, self.num_slots)

    def start(self, meta: KVConnectMeta) -> None:
        """Before the forward pass: load the planned hits into their blocks."""
        for load in meta.offload_loads:
            ids = np.asarray(load.block_ids, dtype=np.int64)
            try:
                self._mover.load(np.asarray(load.slots, dtype=np.int64), ids, self._mover.engine_event(),
                                 self.timeout_s)
                self._stats.add(blocks_loaded=len(ids))
            except Exception as exc:  # the blocks are recomputed by vLLM: report them, keep serving
                log.warning("kvconnect offload: load of %d blocks failed: %s", len(ids), exc)
                self._invalid.update(load.block_ids)

    def after_forward(self, meta: KVConnectMeta) -> None:
        """After the forward pass: copy finished requests' blocks into their slots."""
        for store in meta.offload_stores:
            try:
                self._mover.store(np.asarray(store.block_ids, dtype=np.int64), np.asarray(store.slots, dtype=np.int64),
                                  self._mover.engine_event(), self.timeout_s)
                self._stats.add(blocks_stored=len(store.block_ids))
            except Exception as exc:  # the blocks are only a cache: losing them costs a future miss
                log.warning("kvconnect offload: store for %s failed: %s", store.request_id, exc)
                self._failed_stores.add(store.request_id)
            self._sent.add(store.request_id)

    def finished_sending(self) -> set[str]:
        """Requests whose store ran since the last call (vLLM may free their blocks)."""
        sent, self._sent = self._sent, set()
        return sent

    def worker_meta(self) -> KVConnectWorkerMeta | None:
        """Stores that failed since the last call, for the scheduler not to publish them."""
        if not self._failed_stores:
            return None
        out, self._failed_stores = KVConnectWorkerMeta(failed_stores=self._failed_stores), set()
        return out

    def invalid_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        bad, self._invalid = self._invalid, set()
        return bad

    def stats(self) -> KVConnectStats | None:
        """This interval's block counts."""
        return self._stats.take()

    def shutdown(self) -> None:
        """Drop the pool."""
        self._mover = None
