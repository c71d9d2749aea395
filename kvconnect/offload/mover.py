"""The worker side of the offload tier: the host pool and the copies between it and the KV cache.

Every region is seen as rows: a `(num_blocks, words)` tensor over the registered storage whose row
`i` is block `i` (row stride = block stride, so strided per-layer views of a cross-layer buffer work
without a copy), and the pool holds one `(num_slots, words)` tensor per region. A store or load is
then one `index_select`/`index_copy_` per region and per run of consecutive slots (at most 8 runs;
beyond that, per 4 MiB staging chunk): never one torch call per block. Rows use the widest element that the block size,
stride and offset allow (16-byte complex128 when aligned): torch's indexed copies move one element
per step, and plain element copies never alter bits, so bytes are moved exactly.

On CUDA the copies run on a dedicated stream, ordered after the engine's stream by an event the
caller records at submission, and the worker thread waits (bounded) on a completion event, so the
engine's stream never blocks; the pool is pinned so copy engines reach it directly. That CUDA code
has not been run: the tests and the benchmark here run on CPU only, where the same plan (runs,
staging, word views) runs with host copies.
"""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np
import torch

from kvconnect.errors import LayoutError, TransferError
from kvconnect.offload.quarantine import SlotQuarantine
from kvconnect.regions import Region, RegionSet

# Beyond this many runs of consecutive slots, per-run calls would approach one call per block, so the
# copy goes through a bounded staging buffer instead (two copies, one call per chunk).
MAX_RUNS = 8
STAGE_BYTES = 4 << 20
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(*byte_counts: int) -> tuple[int, torch.dtype]:
    for size, dtype in _WORDS:
        if all(n % size == 0 for n in byte_counts):
            return size, dtype
    return 1, torch.uint8


def region_rows(kv_caches: Mapping[str, torch.Tensor], region: Region) -> torch.Tensor:
    """A `(num_blocks, words)` view of a region's blocks over the storage that holds them (no copy)."""
    for name in region.names:
        tensor = kv_caches[name]
        storage = tensor.untyped_storage()
        start = region.base_addr - storage.data_ptr()
        if 0 <= start and start + region.span_bytes <= storage.nbytes():
            break
    else:
        raise LayoutError(f"region {region.label}: no registered tensor's storage holds all of its blocks")
    stride = region.block_stride if region.num_blocks > 1 else region.block_bytes
    size, dtype = _word(region.block_bytes, stride, start)
    rows = torch.empty(0, dtype=dtype, device=tensor.device)
    return rows.set_(storage, start // size, (region.num_blocks, region.block_bytes // size), (stride // size, 1))


def slot_runs(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of consecutive slots as (position in the job, first slot, length) arrays."""
    if slots.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    starts = np.concatenate(([0], np.flatnonzero(np.diff(slots) != 1) + 1))
    lengths = np.diff(np.append(starts, slots.size))
    return starts, slots[starts], lengths


def wait_event(event: "torch.cuda.Event", timeout: float, what: str) -> None:
    """Wait for a CUDA event by polling, so the worker thread never blocks without a deadline."""
    deadline = time.monotonic() + timeout
    delay = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferError(f"{what} did not complete on the GPU within {timeout} s")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class BlockMover:
    """Host pool of `num_slots` slots for every region, and vectorised copies between it and the cache."""

    max_runs = MAX_RUNS
    stage_bytes = STAGE_BYTES

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], regions: RegionSet, num_slots: int):
        self.rows = [region_rows(kv_caches, r) for r in regions]
        devices = {t.device for t in self.rows}
        if len(devices) != 1:
            raise LayoutError(f"the offload tier needs every KV cache on one device, got {sorted(map(str, devices))}")
        (self.device,) = devices
        self.is_cuda = self.device.type == "cuda"
        self.num_slots = num_slots
        self.block_bytes = [r.block_bytes for r in regions]
        # Pinned host memory lets the GPU copy engines read and write the pool directly.
        self.pool = [torch.empty((num_slots, rows.shape[1]), dtype=rows.dtype, pin_memory=self.is_cuda)
                     for rows in self.rows]
        if not self.is_cuda:
            # Touch every page now so the first stores do not pay the page faults.
            for p in self.pool:
                p.zero_()
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # Set when GPU copies timed out: they may still be writing pool slots or cache blocks, so no
        # further copy may reuse either.
        self.broken: str | None = None
        # Slots a lower tier's abandoned read may still write: a store into them is dropped (the tiers' PoolView shares it).
        self.quarantine = SlotQuarantine(num_slots)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: one block of every region."""
        return sum(self.block_bytes)

    def _parts(self, regions: np.ndarray | None) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(cache rows, pool, block bytes) of the selected regions (all by default)."""
        picked = range(len(self.rows)) if regions is None else [int(k) for k in regions]
        return [(self.rows[k], self.pool[k], self.block_bytes[k]) for k in picked]

    def engine_event(self) -> "torch.cuda.Event | None":
        """On CUDA, an event on the caller's current stream: copies start after the work queued so far."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    # ---- store: cache rows -> pool slots ----

    def store(self, block_ids: np.ndarray, slots: np.ndarray, after=None, timeout: float = 60.0,
              regions: np.ndarray | None = None) -> None:
        """Copy blocks `block_ids` of the selected regions (default all) into pool `slots`; returns when in the pool."""
        self._move(True, block_ids, slots, after, timeout, regions)

    def _move(self, to_pool: bool, block_ids: np.ndarray, slots: np.ndarray, after, timeout: float,
              regions: np.ndarray | None) -> None:
        if block_ids.size == 0:
            return
        if to_pool and self.quarantine.held(slots).any():
            raise TransferError("pool slots of this store may still be written by a lower tier's read abandoned at "
                                "its deadline; the store is dropped")
        parts = self._parts(regions)
        if not self.is_cuda:
            self._host_copy(parts, block_ids, slots, to_pool)
            return
        self._check_usable()
        if to_pool:
            self._store_cuda(parts, block_ids, slots, after, timeout)
        else:
            self._load_cuda(parts, slots, block_ids, after, timeout)

    def _host_copy(self, parts: list, block_ids: np.ndarray, slots: np.ndarray, to_pool: bool) -> None:
        """Host copies between cache rows and pool slots: one call per run of slots, or per staging chunk."""
        ids = torch.from_numpy(np.array(block_ids, dtype=np.int64))  # a copy: checked ids are read-only
        pos, first, count = slot_runs(slots)
        if pos.size <= self.max_runs:
            for rows, pool, _ in parts:
                for p, a, n in zip(pos.tolist(), first.tolist(), count.tolist()):
                    if to_pool:
                        torch.index_select(rows, 0, ids[p:p + n], out=pool[a:a + n])
                    else:
                        rows.index_copy_(0, ids[p:p + n], pool[a:a + n])
            return
        slot_t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        src_ids, dst_ids = (ids, slot_t) if to_pool else (slot_t, ids)
        for rows, pool, nbytes in parts:
            src, dst = (rows, pool) if to_pool else (pool, rows)
            chunk = max(1, self.stage_bytes // nbytes)
            stage = torch.empty((min(chunk, ids.numel()), rows.shape[1]), dtype=rows.dtype)
            for c in range(0, ids.numel(), chunk):
                got = torch.index_select(src, 0, src_ids[c:c + chunk], out=stage[: min(chunk, ids.numel() - c)])
                dst.index_copy_(0, dst_ids[c:c + chunk], got)

    def _check_usable(self) -> None:
        if self.broken:
            raise TransferError(f"the offload tier is disabled: {self.broken}")

    def _wait(self, event: "torch.cuda.Event", timeout: float, what: str) -> None:
        try:
            wait_event(event, timeout, what)
        except TransferError as exc:
            self.broken = str(exc)
            raise

    def _device_ids(self, ids: np.ndarray, keep: list[torch.Tensor]) -> torch.Tensor:
        """Block ids on the GPU, copied from pinned memory so the worker does not block on the stream."""
        host = torch.from_numpy(np.array(ids, dtype=np.int64)).pin_memory()  # a copy: checked ids are read-only
        keep.append(host)  # the asynchronous copy reads it until the completion event
        return host.to(self.device, non_blocking=True)

    def _store_cuda(self, parts: list, block_ids: np.ndarray, slots: np.ndarray, after, timeout: float) -> None:
        pos, first, count = slot_runs(slots)
        direct = pos.size <= self.max_runs
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        keep: list[torch.Tensor] = []
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            ids = self._device_ids(block_ids, keep)
            for rows, pool, _ in parts:
                # Gather on the GPU (its bandwidth is plentiful), then one device-to-host copy per run.
                gathered = rows.index_select(0, ids)
                if direct:
                    for p, a, n in zip(pos.tolist(), first.tolist(), count.tolist()):
                        pool[a:a + n].copy_(gathered[p:p + n], non_blocking=True)
                else:
                    host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                    host.copy_(gathered, non_blocking=True)
                    staged.append((pool, host))
            done = torch.cuda.Event()
            done.record(self._stream)
        self._wait(done, timeout, "offload store")
        del keep
        if staged:
            slot_t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
            for pool, host in staged:
                pool.index_copy_(0, slot_t, host)

    # ---- load: pool slots -> cache rows ----

    def load(self, slots: np.ndarray, block_ids: np.ndarray, after=None, timeout: float = 60.0,
             regions: np.ndarray | None = None) -> None:
        """Copy pool `slots` into blocks `block_ids` of the selected regions (default all); returns when in the cache."""
        self._move(False, block_ids, slots, after, timeout, regions)

    def _load_cuda(self, parts: list, slots: np.ndarray, block_ids: np.ndarray, after, timeout: float) -> None:
        pos, first, count = slot_runs(slots)
        direct = pos.size <= self.max_runs
        slot_t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        keep: list[torch.Tensor] = []  # pinned sources must outlive the asynchronous copies
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            ids = self._device_ids(block_ids, keep)
            for rows, pool, _ in parts:
                staging = torch.empty((block_ids.size, rows.shape[1]), dtype=rows.dtype, device=self.device)
                if direct:
                    for p, a, n in zip(pos.tolist(), first.tolist(), count.tolist()):
                        staging[p:p + n].copy_(pool[a:a + n], non_blocking=True)
                else:
                    host = torch.empty((block_ids.size, rows.shape[1]), dtype=rows.dtype, pin_memory=True)
                    torch.index_select(pool, 0, slot_t, out=host)
                    staging.copy_(host, non_blocking=True)
                    keep.append(host)
                rows.index_copy_(0, ids, staging)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._wait(done, timeout, "offload load")
        del keep
