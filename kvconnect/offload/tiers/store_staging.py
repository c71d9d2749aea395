"""The store tier's staged get: objects land in a registered staging area, checked pages go into slots.

An object is a page's rows, region by region, then a 16-byte trailer (magic and the page's checksum
over its key and bytes). A get is bounded by a deadline, and Mooncake gives no way to cancel a call:
an abandoned one still writes when it returns. So every get lands in the staging rows, which no other
get uses until that call is over, and only pages whose length and checksum are right are copied into
their pool slots; an abandoned call never writes into a slot since handed to another page. The check
and copy of one part of a get overlap the transfer of the next (two halves of staging rows).
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
from kvconnect.offload.tiers.hostbuffers import page_rows
from kvconnect.offload.tiers.integrity import page_checksums

log = logging.getLogger("kvconnect.offload.store")

TRAILER_MAGIC = int(np.frombuffer(b"KVCSTOR1", dtype="<u8")[0])
TRAILER_BYTES = 16
GET_STAGING_BYTES = 128 << 20  # of pages (and their trailers), two halves; verified pages are copied from here
# Mooncake's codes for an object that is absent, for one larger than the buffer given, and for a
# failed transfer (what a multi-buffer get answers for an object shorter than its buffers).
NOT_FOUND, TOO_LARGE, TRANSFER_FAIL = -704, -600, -800


class _Half:
    """Half of the staging rows: one get's objects land here while the other half's are checked."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows
        self.free = threading.Lock()  # held by a get from its call until its pages are landed


class StagingArea:
    """Registered rows, one object each, that a bounded get lands in before its pages reach the pool.

    The rows are two halves: while the objects of one part of a get are checked and copied into
    their slots (on the helper thread: the hash and the copy release the GIL), the next part's
    objects are read into the other half, so the check and the copy overlap the transfer.
    """

    def __init__(self, pool: PoolView, max_rows: int, calls: InFlight, on_abandoned: Callable[[int], None],
                 split: bool = False):
        width = pool.page_bytes + TRAILER_BYTES
        # Sized by pages, the trailers besides, so that each half holds one whole batch (the store's
        # MAX_BATCH_BYTES, 64 MiB): 64 pages of 2 MiB land in two calls, as Mooncake's own get moves
        # them, where halves of 32 MiB took four (measured at 0.60-0.65 of the raw get against
        # 0.69-0.75). Pages of 512 KiB or less fill MAX_BATCH_KEYS first, in 64 MiB or less.
        self.rows = page_rows(max(1, min(max_rows, GET_STAGING_BYTES // pool.page_bytes)), width)
        half = max(1, self.rows.shape[0] // 2)
        self._halves = [_Half(self.rows[i:i + half]) for i in range(0, self.rows.shape[0] - half + 1, half)]
        self._pool = pool
        # Mooncake moves each buffer of a multi-buffer get as a transfer of its own, in parallel: a
        # page of long rows lands faster as one buffer per row (and one for the trailer) than as one
        # buffer, while short rows are cheaper as one transfer (the put side's `gathers` decides both).
        self._pieces = None
        if split:
            ends = np.cumsum(pool.row_bytes)
            self._pieces = (np.concatenate(([0], ends)).astype(np.uint64),
                            [int(n) for n in pool.row_bytes] + [TRAILER_BYTES])
        self._calls = calls
        self._on_abandoned = on_abandoned  # told how many objects a get abandoned at its deadline
        self._lock = threading.Lock()
        self.stuck = False  # an abandoned get has not returned yet

    @property
    def splits(self) -> bool:
        """Whether an object lands as a buffer per row and one for its trailer (long rows)."""
        return self._pieces is not None

    @property
    def capacity(self) -> int:
        """How many objects one staged call reads."""
        return self._halves[0].rows.shape[0]

    def get_many(self, client: Any, names: list[str], slots: np.ndarray,
                 deadline: float) -> tuple[np.ndarray, np.ndarray]:
        """(bytes per object, verified) for objects read a part at a time into the staging rows and, if
        good, copied into `slots`; a part whose call raised or missed `deadline` ends the get, and it
        and the parts after it read as not found."""
        got = np.full(len(names), NOT_FOUND, dtype=np.int64)
        ok = np.zeros(len(names), dtype=bool)
        landing: list = [None] * len(self._halves)  # per half: the helper's landing of its last part
        try:
            for k, start in enumerate(range(0, len(names), self.capacity)):
                half = self._halves[k % len(self._halves)]
                if landing[k % len(self._halves)] is not None:
                    overlap.result(landing[k % len(self._halves)])  # the half is free again
                part = slice(start, min(len(names), start + self.capacity))
                codes = self._call(half, client, names[part], deadline)
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

    def _call(self, half: _Half, client: Any, names: list[str], deadline: float) -> np.ndarray | None:
        """Mooncake's bytes per object, read into `half` (whose lock it then holds, for `_land` to
        release); None when the call raised or did not return by `deadline` (it keeps the half)."""
        if not half.free.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return None
        stage, n, width = half.rows, len(names), half.rows.shape[1]
        stride = stage.strides[0]
        box: dict[str, object] = {}
        done = threading.Event()

        def call() -> None:
            try:
                bases = stage.ctypes.data + np.arange(n, dtype=np.uint64) * stride
                box["got"] = self._get_into(client, names, bases, width)
            except Exception as exc:  # noqa: BLE001 - reported by the waiting get
                box["error"] = exc
            with self._lock:
                done.set()
                abandoned = box.get("abandoned", False)
                self.stuck = self.stuck and not abandoned
            if abandoned:
                half.free.release()

        self._calls.start(call, "kvconnect-store-get")
        done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not done.is_set():
                box["abandoned"] = self.stuck = True
        if box.get("abandoned"):
            self._on_abandoned(n)
            return None
        if "error" in box:
            half.free.release()
            log.warning("store tier: a get of %d objects failed (%s); they are misses", n, box["error"])
            return None
        return np.asarray(box["got"], dtype=np.int64)

    def _get_into(self, client: Any, names: list[str], bases: np.ndarray, width: int) -> np.ndarray:
        """Mooncake's bytes per object, each read into the staging row at its base address."""
        if self._pieces is None:
            return client.batch_get_into(names, bases.tolist(), [width] * len(names))
        offsets, sizes = self._pieces
        got = client.batch_get_into_multi_buffers(names, (bases[:, None] + offsets[None, :]).tolist(),
                                                  [sizes] * len(names))
        # A multi-buffer get answers TRANSFER_FAIL for an object shorter than its buffers, where a
        # one-buffer get answers the object's length: asked again as one buffer, a short (corrupt)
        # object is told apart from a failed transfer, and rejected as the one-buffer path rejects it.
        got = np.asarray(got, dtype=np.int64)
        again = np.flatnonzero(got == TRANSFER_FAIL)
        if again.size:
            got[again] = client.batch_get_into([names[i] for i in again], bases[again].tolist(), [width] * again.size)
        return got

    def _land(self, half: _Half, names: list[str], got: np.ndarray, slots: np.ndarray, ok: np.ndarray) -> None:
        """Check each staged object's length, trailer and checksum, copy the good ones into their slots,
        mark them in `ok` (a view of the get's result); then free the half."""
        try:
            pool, page = self._pool, self._pool.page_bytes
            stage = half.rows[:len(names)]
            whole = np.flatnonzero(got == page + TRAILER_BYTES)
            if whole.size:
                pages = stage[:, :page] if whole.size == len(names) else stage[whole, :page]
                trailer = np.ascontiguousarray(stage[whole, page:]).view("<u8")
                sums = page_checksums([names[i].encode() for i in whole], pages)
                ok[whole] = (trailer[:, 0] == TRAILER_MAGIC) & (trailer[:, 1] == sums)
            good = np.flatnonzero(ok)
            # Runs of good objects bound for consecutive slots: one copy per run and region, no temporary.
            breaks = np.flatnonzero((np.diff(good) != 1) | (np.diff(slots[good]) != 1)) + 1
            for run in np.split(good, breaks) if good.size else ():
                a, b, first = int(run[0]), int(run[-1]) + 1, int(slots[run[0]])
                start = 0
                for rows in pool.rows:
                    rows[first:first + b - a] = stage[a:b, start:start + rows.shape[1]]
                    start += rows.shape[1]
        finally:
            half.free.release()
