"""The worker-side half of KVConnectOffload: the host pool and the copies the scheduler planned.

Loads run before the forward pass that reads their blocks; stores after the forward pass that
wrote them (a boundary state, too: vLLM frees its block two steps later at the earliest, so the
copy, done before this step ends, always comes first). A failed load reports its blocks as invalid
(vLLM recomputes them); a failed store only costs a future miss. With lower tiers, stored blocks are
also written down in the background, and a load that needs blocks from below runs on a worker
thread (the request waits, the engine steps on) and is reported in finished_recving when done.

With tensor parallelism each rank's worker holds its own shard of every block in its own pool, at
the slots the one scheduler chose, and writes it below under its shard's keys (`shard`), so no rank
is ever served another rank's heads, nor an engine of another TP size its shards.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from kvconnect.errors import TransferError
from kvconnect.integrations.vllm.config import TierConfig
from kvconnect.integrations.vllm.dump import PageDump
from kvconnect.integrations.vllm.meta import KVConnectMeta, KVConnectWorkerMeta, OffloadLoad, OffloadStore
from kvconnect.integrations.vllm.stats import KVConnectStats, StepStats
from kvconnect.integrations.vllm.tiers import make_tiers
from kvconnect.offload.jobs import JobRunner, OffloadJob
from kvconnect.offload.keys import shard_keys
from kvconnect.offload.mover import BlockMover
from kvconnect.offload.recompute import saved_seconds
from kvconnect.offload.tiers import PoolView, leading
from kvconnect.offload.tiers.chain import TierChain
from kvconnect.offload.tiers.disk import DiskTier
from kvconnect.regions import RegionSet

log = logging.getLogger("kvconnect.vllm")

_UNRATED_MAX = 1024  # loads kept for the estimate until the engine has a rate (the rest get none)


class OffloadWorker:
    """Runs one engine worker's tier copies."""

    def __init__(self, *, num_slots: int, slot_bytes: int, timeout_s: float, connector: str,
                 tiers: Sequence[TierConfig] = (), namespace: bytes = b"", tp: int = 1, rank: int = 0,
                 shard: bytes = b"", check_split: Callable[[dict[str, torch.Tensor]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.num_slots = num_slots
        self.rank, self.tp = rank, tp
        self._dump: PageDump | None = None  # a test-only window on the pages (KVCONNECT_DUMP_DIR)
        self.shard = shard
        self._check_split = check_split
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.connector = connector
        self._mover: BlockMover | None = None
        self._sent: set[str] = set()
        self._failed_stores: set[str] = set()
        self._invalid: set[int] = set()
        self._stats = StepStats(with_metrics=False)
        # Built here, so a tier directory that cannot be written fails at start, not at the first store.
        self._tiers = make_tiers(tiers, namespace, tp, rank)
        self._chain: TierChain | None = None
        self._fetcher: JobRunner | None = None
        self._lock = threading.Lock()  # the sets below are also written by the tier threads
        self._recved: set[str] = set()
        self._failed_recv: set[str] = set()  # of those, loads that failed their request (several groups)
        self._failed_out: set[str] = set()  # failed loads that finished_recving handed out, for failed_recving
        self._failed_fetches: set[str] = set()
        self._written: set[tuple[str, int]] = set()
        self._stored: set[tuple[str, int]] = set()  # boundary-state store jobs that ran, with this rank
        self._fetched = 0
        self._clock = clock
        self._rate = 0.0  # seconds per token, as the scheduler last measured it
        self._timed: list[tuple[int, float]] = []  # asynchronous loads ended: (tokens saved, seconds)
        self._unrated: list[tuple[int, float]] = []  # loads timed before the engine had a rate

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Allocate the host pool for these caches (one slot holds one block of every region)."""
        if self._check_split is not None:
            self._check_split(kv_caches)
        regions = RegionSet.from_kv_caches(kv_caches)
        got = sum(r.block_bytes for r in regions)
        if got != self.slot_bytes:
            raise ValueError(f"{self.connector}: registered KV caches hold {got} bytes per block, the KV-cache "
                             f"config says {self.slot_bytes}; this layout is not supported")
        self._mover = BlockMover(kv_caches, regions, self.num_slots)
        self._dump = PageDump.from_env(kv_caches, (), self.rank if self.tp > 1 else None)
        if self._tiers:
            view = PoolView(tuple(p.view(torch.uint8).numpy() for p in self._mover.pool), self._mover.quarantine)
            self._chain = TierChain(self._tiers, view)
            self._fetcher = JobRunner(1, name="kvconnect-offload-fetch")

    def start(self, meta: KVConnectMeta) -> None:
        """Before the forward pass: load the planned hits into their blocks."""
        self._rate = meta.seconds_per_token or self._rate
        if self._rate > 0 and self._unrated:
            unrated, self._unrated = self._unrated, []
            for tokens, seconds in unrated:
                self._estimate(tokens, seconds)
        for load in meta.offload_loads:
            if load.request_id:
                self._fetch(load)
                continue
            ids = np.asarray(load.block_ids, dtype=np.int64)
            if load.invalid_block_ids:  # allocated, but the tier holds no page for them: vLLM recomputes
                with self._lock:
                    self._invalid.update(load.invalid_block_ids)
            began = self._clock()
            try:
                self._mover.load(np.asarray(load.slots, dtype=np.int64), ids, self._mover.engine_event(),
                                 self.timeout_s)
                self._stats.add(blocks_loaded=len(ids))
                self._dump_pages("loaded", load.keys, load.block_ids)
                self._credit(0 if load.invalid_block_ids else load.tokens, self._clock() - began)
            except Exception as exc:  # the blocks are recomputed by vLLM: report them, keep serving
                log.warning("kvconnect offload: load of %d blocks failed: %s", len(ids), exc)
                with self._lock:
                    self._invalid.update(load.block_ids)
                self._credit(0, self._clock() - began)

    def _credit(self, tokens: int, seconds: float) -> None:
        """Count a load's seconds and what it saved against recomputing `tokens` (none when any of its
        blocks is recomputed), once the engine has a rate; TP rank 0 speaks for the engine."""
        if self.rank != 0:
            return
        self._stats.add(load_seconds=seconds)
        if self._rate > 0:
            self._estimate(tokens, seconds)
        elif len(self._unrated) < _UNRATED_MAX:  # a fresh engine's first loads come before any timed step
            self._unrated.append((tokens, seconds))

    def _estimate(self, tokens: int, seconds: float) -> None:
        self._stats.add(load_recompute_seconds_est=tokens * self._rate,
                        load_saved_seconds_est=saved_seconds(tokens, seconds, self._rate))

    def after_forward(self, meta: KVConnectMeta) -> None:
        """After the forward pass: copy finished requests' blocks into their slots."""
        for store in meta.offload_stores:
            try:
                self._mover.store(np.asarray(store.block_ids, dtype=np.int64), np.asarray(store.slots, dtype=np.int64),
                                  self._mover.engine_event(), self.timeout_s)
                self._stats.add(blocks_stored=len(store.block_ids))
                self._dump_pages("stored", store.keys, store.block_ids)
                self._write_down(store)
            except Exception as exc:  # the blocks are only a cache: losing them costs a future miss
                log.warning("kvconnect offload: store for %s failed: %s", store.request_id, exc)
                with self._lock:
                    self._failed_stores.add(store.request_id)
                    if self._chain is not None:  # this rank is done with the slots (other ranks may not be)
                        self._written.add((store.request_id, self.rank))
            if store.notify:
                self._sent.add(store.request_id)
            else:  # a running request's boundary state: vLLM must not hear of it as finished sending
                with self._lock:
                    self._stored.add((store.request_id, self.rank))

    def _write_down(self, store: OffloadStore) -> None:
        """Queue a stored request's pages for the lower tiers; the scheduler unpins them when reported."""
        if self._chain is None or not store.keys:
            return
        rid = store.request_id

        def done(_keys: object) -> None:
            with self._lock:
                self._written.add((rid, self.rank))

        if self._chain.write_behind(shard_keys(store.keys, self.shard), np.asarray(store.slots, dtype=np.int64), done) == 0:
            done(None)

    def _dump_pages(self, kind: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """With KVCONNECT_DUMP_DIR set (tests only): each block's pages in a file named by its key."""
        if self._dump is not None:
            for key, block in zip(keys, block_ids):
                self._dump.write(kind, key.hex(), [[block]])

    def _fetch(self, load: OffloadLoad) -> None:
        """An asynchronous load: pages up from the lower tiers, then every slot into its block (on this thread
        when nothing comes up from below)."""
        slots = np.asarray(load.slots, dtype=np.int64)
        ids = np.asarray(load.block_ids, dtype=np.int64)
        after = self._mover.engine_event()
        began = self._clock()
        # Blocks whose bytes are in the engine's blocks: none until the copy returned. Whatever fails
        # before (a tier raising, the copy failing) leaves every block of the load invalid.
        usable = [0]

        def work() -> None:
            if load.failed:
                raise TransferError("the tier holds no usable state for this hit")
            got = np.zeros(0, dtype=bool)
            if load.fetch_keys:
                got = self._chain.fetch(shard_keys(load.fetch_keys, self.shard), slots[load.fetch_from:])
            ready = load.fetch_from + leading(got)
            if ready:
                self._mover.load(slots[:ready], ids[:ready], after, self.timeout_s)
                self._dump_pages("loaded", load.keys, load.block_ids[:load.fetch_from])
                self._dump_pages("loaded", load.fetch_keys, load.block_ids[load.fetch_from:ready])
            usable[0] = ready
            if not got.all():
                raise TransferError(f"{int((~got).sum())} of {got.size} blocks missing or corrupt in the lower tiers")

        def finish(err: BaseException | None) -> None:
            with self._lock:
                whole = err is None and not load.invalid_block_ids
                if err is not None:
                    log.warning("kvconnect offload: load of %s: %s", load.request_id, err)
                    self._failed_fetches.add(load.request_id)
                if load.fail_request:
                    if not whole:
                        self._failed_recv.add(load.request_id)
                else:
                    if err is not None:
                        self._invalid.update(load.block_ids[usable[0]:])
                    self._invalid.update(load.invalid_block_ids)
                self._recved.add(load.request_id)
                self._fetched += usable[0]
                self._timed.append((load.tokens if whole else 0, self._clock() - began))

        if load.fetch_keys:
            self._fetcher.submit(OffloadJob("load", tuple(load.fetch_keys), ids, 0, work, finish))
            return
        try:
            work()
        except Exception as exc:  # reported like a failed fetch: the request is recomputed or failed
            finish(exc)
        else:
            finish(None)

    def finished_sending(self) -> set[str]:
        """Requests whose store ran since the last call (vLLM may free their blocks)."""
        sent, self._sent = self._sent, set()
        return sent

    def finished_recving(self) -> set[str]:
        """Asynchronous loads that ended since the last call (their failed blocks are in invalid_blocks)."""
        with self._lock:
            done, self._recved = self._recved, set()
            # Taken with `done`, so a failure is never reported in a step before or after its end.
            self._failed_out |= self._failed_recv & done
            self._failed_recv -= done
            fetched, self._fetched = self._fetched, 0
            timed, self._timed = self._timed, []
        self._stats.add(blocks_loaded=fetched)  # StepStats is the engine thread's alone
        for tokens, seconds in timed:
            self._credit(tokens, seconds)
        return done

    def worker_meta(self) -> KVConnectWorkerMeta | None:
        """What the scheduler must know since the last call: failed stores and fetches, write-downs, disk changes."""
        with self._lock:
            out = KVConnectWorkerMeta(failed_stores=self._failed_stores, failed_fetches=self._failed_fetches,
                                      written_down=self._written, stored=self._stored)
            self._failed_stores, self._failed_fetches, self._written, self._stored = set(), set(), set(), set()
        for tier in self._tiers:
            if isinstance(tier, DiskTier):
                out.disk_stored, out.disk_gone = tier.drain_changes()
        empty = not (out.failed_stores or out.failed_fetches or out.written_down or out.disk_stored or out.disk_gone
                     or out.stored)
        return None if empty else out

    def failed_recving(self) -> set[str]:
        """Of the loads the last finished_recving returned, those that failed their request (several groups)."""
        failed, self._failed_out = self._failed_out, set()
        return failed

    def invalid_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        with self._lock:
            bad, self._invalid = self._invalid, set()
        return bad

    def stats(self) -> KVConnectStats | None:
        """This interval's block counts."""
        return self._stats.take()

    def shutdown(self) -> None:
        """Finish what the tier threads hold (bounded), then drop the pool."""
        try:
            if self._fetcher is not None:
                self._fetcher.close(self.timeout_s)
            if self._chain is not None:
                self._chain.close(self.timeout_s)
        finally:
            self._mover = None
