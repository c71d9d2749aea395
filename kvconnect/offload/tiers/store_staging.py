"""The store tier's bounded get: objects checked before any page counts, a part landing while the next arrives.

An object is a page's rows, region by region, then a 16-byte trailer (magic and the page's checksum
over its key and bytes). A get is bounded by a deadline, and Mooncake gives no way to cancel a call:
an abandoned one still writes when it returns. Where each object lands depends on its rows:

- Short rows: one buffer per object, in registered staging rows that no other get uses until the
  call is over; only pages whose length and checksum are right are copied into their pool slots.
- Long rows (256 KiB or more on average): straight into the pool slots, a buffer per row, and the
  trailer into a staging row. Mooncake moves each buffer as a transfer of its own, in parallel, and
  there is no copy of every byte after it; the pages are checked in their slots. An abandoned call's
  slots are held in the pool's quarantine until it returns, so no other page is written there
  before the late write is over (`kvconnect.offload.quarantine`).

The check (and the copy) of one part of a get overlap the transfer of the next (two halves of
staging rows).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from kvconnect.offload.tiers import overlap
from kvconnect.offload.tiers.base import PoolView
from kvconnect.offload.tiers.calls import InFlight
from kvconnect.offload.tiers.hostbuffers import aligned, page_rows
from kvconnect.offload.tiers.integrity import page_checksums, slot_checksums

log = logging.getLogger("kvconnect.offload.store")

TRAILER_MAGIC = int(np.frombuffer(b"KVCSTOR1", dtype="<u8")[0])
TRAILER_BYTES = 16
GET_STAGING_BYTES = 128 << 20  # of pages (and their trailers), two halves; verified pages are copied from here
# Mooncake's codes for an object that is absent, for one larger than the buffer given, and for a
# failed transfer (what a multi-buffer get answers for an object shorter than its buffers).
NOT_FOUND, TOO_LARGE, TRANSFER_FAIL = -704, -600, -800


def object_buffers(pool: PoolView, slots: np.ndarray,
                   trailers: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """Per object, the address and size of its slot's row in every region, then of its trailer (at
    address `trailers[i]`): the buffers of a multi-buffer put or get straight from or into the pool."""
    addrs = np.concatenate([pool.addresses(slots), np.asarray(trailers, dtype=np.uint64)[:, None]], axis=1)
    return addrs.tolist(), [[int(n) for n in pool.row_bytes] + [TRAILER_BYTES]] * len(slots)


class _Half:
    """Half of the staging rows: one get's objects land here while the other half's are checked."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows
        self.free = threading.Lock()  # held by a get from its call until its pages are landed


class StagingArea:
    """Registered rows, one object (or trailer) each, that a bounded get lands in before its pages count.

    The rows are two halves: while the objects of one part of a get are checked (and copied into
    their slots) on the helper thread, where the hash and the copy release the GIL, the next part's
    objects are read into the other half, so the check overlaps the transfer. With `direct`, the
    pages land in their slots and the rows hold only the trailers.
    """

    def __init__(self, pool: PoolView, max_rows: int, calls: InFlight, on_abandoned: Callable[[int], None],
                 direct: bool = False):
        width = pool.page_bytes + TRAILER_BYTES
        # Sized by pages, the trailers besides, so that each half holds one whole batch (the store's
        # MAX_BATCH_BYTES, 64 MiB): 64 pages of 2 MiB land in two calls, as Mooncake's own get moves
        # them, where halves of 32 MiB took four (measured at 0.60-0.65 of the raw get against
        # 0.69-0.75). Pages of 512 KiB or less fill MAX_BATCH_KEYS first, in 64 MiB or less.
        count = max(1, min(max_rows, GET_STAGING_BYTES // pool.page_bytes))
        self.rows = aligned((count, TRAILER_BYTES)) if direct else page_rows(count, width)
        half = max(1, self.rows.shape[0] // 2)
        self._halves = [_Half(self.rows[i:i + half]) for i in range(0, self.rows.shape[0] - half + 1, half)]
        self._pool = pool
        self._width = width
        self.direct = direct
        self._calls = calls
        self._on_abandoned = on_abandoned  # told how many objects a get abandoned at its deadline
        self._lock = threading.Lock()
        self.stuck = False  # an abandoned get has not returned yet

    @property
    def capacity(self) -> int:
        """How many objects one staged call reads."""
        return self._halves[0].rows.shape[0]

    def get_many(self, client: Any, names: list[str], slots: np.ndarray,
                 deadline: float) -> tuple[np.ndarray, np.ndarray]:
        """(bytes per object, verified) for objects read a part at a time into `slots` (through the
        staging rows unless `direct`), each page counted only once checked; a part whose call raised
        or missed `deadline` ends the get, and it and the parts after it read as not found."""
        got = np.full(len(names), NOT_FOUND, dtype=np.int64)
        ok = np.zeros(len(names), dtype=bool)
        landing: list = [None] * len(self._halves)  # per half: the helper's landing of its last part
        try:
            for k, start in enumerate(range(0, len(names), self.capacity)):
                half = self._halves[k % len(self._halves)]
                if landing[k % len(self._halves)] is not None:
                    overlap.result(landing[k % len(self._halves)])  # the half is free again
                part = slice(start, min(len(names), start + self.capacity))
                codes = self._call(half, client, names[part], slots[part], deadline)
                if codes is None:
                    break  # abandoned or failed: this part and the rest are misses
                got[part] = codes
                landing[k % len(self._halves)] = overlap.later(
                    lambda h=half, p=part, c=codes: self._land(h, names[p], c, slots[p], ok[p]))
        finally:
            for pending in landing:
                if pending is not None:
                    overlap.result(pending)
        return got, ok

    def _call(self, half: _Half, client: Any, names: list[str], slots: np.ndarray,
              deadline: float) -> np.ndarray | None:
        """Mooncake's bytes per object, read into `half` (whose lock it then holds, for `_land` to
        release); None when the call raised or did not return by `deadline` (it keeps the half, and
        with `direct` the slots, until it returns)."""
        if not half.free.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return None
        n, quarantine = len(names), self._pool.quarantine
        box: dict[str, object] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["got"] = self._get_into(client, names, half.rows[:n], slots)
            except Exception as exc:  # noqa: BLE001 - reported by the waiting get
                box["error"] = exc
            with self._lock:
                done.set()
                abandoned = box.get("abandoned", False)
                self.stuck = self.stuck and not abandoned
            if abandoned:
                if self.direct:
                    quarantine.release(slots)
                half.free.release()

        self._calls.start(call, "kvconnect-store-get")
        done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not done.is_set():
                box["abandoned"] = self.stuck = True
                if self.direct:  # held before the call can find itself abandoned and release them
                    quarantine.hold(slots)
        if box.get("abandoned"):
            self._on_abandoned(n)
            return None
        if "error" in box:
            half.free.release()
            log.warning("store tier: a get of %d objects failed (%s); they are misses", n, box["error"])
            return None
        return np.asarray(box["got"], dtype=np.int64)

    def _get_into(self, client: Any, names: list[str], stage: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Mooncake's bytes per object, each read into its staging row, or with `direct` into its slot's
        rows and its trailer into the staging row."""
        bases = stage.ctypes.data + np.arange(len(names), dtype=np.uint64) * np.uint64(stage.strides[0])
        if not self.direct:
            return client.batch_get_into(names, bases.tolist(), [self._width] * len(names))
        got = np.asarray(client.batch_get_into_multi_buffers(names, *object_buffers(self._pool, slots, bases)),
                         dtype=np.int64)
        # A multi-buffer get answers TRANSFER_FAIL for an object shorter than its buffers, where a
        # one-buffer get answers its length: the object's size tells a short (corrupt) one, rejected
        # as the one-buffer path rejects it, from a failed transfer (a miss). Failures only: a loop.
        for i in np.flatnonzero(got == TRANSFER_FAIL).tolist():
            size = int(client.get_size(names[i]))
            if size >= 0 and size != self._width:
                got[i] = size
        return got

    def _land(self, half: _Half, names: list[str], got: np.ndarray, slots: np.ndarray, ok: np.ndarray) -> None:
        """Check each object's length, trailer and checksum, copy the good staged ones into their slots,
        mark them in `ok` (a view of the get's result); then free the half."""
        try:
            stage = half.rows[:len(names)]
            self._check(stage, names, got, slots, ok)
            if not self.direct:
                self._copy_good(stage, slots, ok)
        finally:
            half.free.release()

    def _check(self, stage: np.ndarray, names: list[str], got: np.ndarray, slots: np.ndarray, ok: np.ndarray) -> None:
        """Mark in `ok` (a view) each object whose length, trailer and checksum are right, as landed in
        `stage` (or with `direct`, its page in its slot and its trailer in `stage`)."""
        pool = self._pool
        whole = np.flatnonzero(got == self._width)
        if not whole.size:
            return
        keys = [names[i].encode() for i in whole]
        if self.direct:
            trailer = stage[whole].view("<u8")
            sums = slot_checksums(keys, pool, slots[whole])
        else:
            trailer = np.ascontiguousarray(stage[whole, pool.page_bytes:]).view("<u8")
            pages = stage[:, :pool.page_bytes] if whole.size == len(names) else stage[whole, :pool.page_bytes]
            sums = page_checksums(keys, pages)
        ok[whole] = (trailer[:, 0] == TRAILER_MAGIC) & (trailer[:, 1] == sums)

    def _copy_good(self, stage: np.ndarray, slots: np.ndarray, ok: np.ndarray) -> None:
        """Copy the verified staged pages into their slots: one copy per run and region, no temporary."""
        good = np.flatnonzero(ok)
        breaks = np.flatnonzero((np.diff(good) != 1) | (np.diff(slots[good]) != 1)) + 1
        for run in np.split(good, breaks) if good.size else ():
            a, b, first = int(run[0]), int(run[-1]) + 1, int(slots[run[0]])
            start = 0
            for rows in self._pool.rows:
                rows[first:first + b - a] = stage[a:b, start:start + rows.shape[1]]
                start += rows.shape[1]
