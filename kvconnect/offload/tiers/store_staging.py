"""The store tier's staged get: objects land in a registered staging area, checked pages go into slots.

An object is a page's rows, region by region, then a 16-byte trailer (magic and the page's checksum
over its key and bytes). A get is bounded by a deadline, and Mooncake gives no way to cancel a call:
an abandoned one still writes when it returns. So every get lands in the staging rows, which no other
get uses until that call is over, and only pages whose length and checksum are right are copied into
their pool slots; an abandoned call never writes into a slot since handed to another page.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from kvconnect.offload.tiers.base import PoolView
from kvconnect.offload.tiers.calls import InFlight
from kvconnect.offload.tiers.integrity import page_checksums

log = logging.getLogger("kvconnect.offload.store")

TRAILER_MAGIC = int(np.frombuffer(b"KVCSTOR1", dtype="<u8")[0])
TRAILER_BYTES = 16
GET_STAGING_BYTES = 32 << 20  # verified pages are copied from here into their slots
# Mooncake's codes for an object that is absent, and for one larger than the buffer given.
NOT_FOUND, TOO_LARGE = -704, -600


class StagingArea:
    """Registered rows, one object each, that a bounded get lands in before its pages reach the pool."""

    def __init__(self, pool: PoolView, max_rows: int, calls: InFlight, on_abandoned: Callable[[int], None]):
        width = pool.page_bytes + TRAILER_BYTES
        self.rows = np.zeros((max(1, min(max_rows, GET_STAGING_BYTES // width)), width), dtype=np.uint8)
        self._pool = pool
        self._calls = calls
        self._on_abandoned = on_abandoned  # told how many objects a get abandoned at its deadline
        self._free = threading.Lock()  # held by a get, or by its abandoned Mooncake call
        self._lock = threading.Lock()
        self.stuck = False  # an abandoned get has not returned yet

    @property
    def capacity(self) -> int:
        """How many objects one staged get reads."""
        return self.rows.shape[0]

    def get(self, client: Any, names: list[str], slots: np.ndarray,
            deadline: float) -> tuple[np.ndarray, np.ndarray] | None:
        """(bytes per object, verified) for objects read into the staging rows and, if good, copied into
        `slots`; None when the call raised or did not return by `deadline` (it keeps the staging rows)."""
        if not self._free.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return None
        stage, n, width = self.rows, len(names), self.rows.shape[1]
        box: dict[str, object] = {}
        done = threading.Event()

        def call() -> None:
            try:
                ptrs = [stage.ctypes.data + i * width for i in range(n)]
                box["got"] = client.batch_get_into(names, ptrs, [width] * n)
            except Exception as exc:  # noqa: BLE001 - reported by the waiting get
                box["error"] = exc
            with self._lock:
                done.set()
                abandoned = box.get("abandoned", False)
                self.stuck = self.stuck and not abandoned
            if abandoned:
                self._free.release()

        self._calls.start(call, "kvconnect-store-get")
        done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not done.is_set():
                box["abandoned"] = self.stuck = True
        if box.get("abandoned"):
            self._on_abandoned(n)
            return None
        try:
            if "error" in box:
                log.warning("store tier: a get of %d objects failed (%s); they are misses", n, box["error"])
                return None
            got = np.asarray(box["got"], dtype=np.int64)
            return got, self._land(names, got, slots)
        finally:
            self._free.release()

    def _land(self, names: list[str], got: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Check each staged object's length, trailer and checksum; copy the good ones into their slots."""
        pool, page = self._pool, self._pool.page_bytes
        stage = self.rows[:len(names)]
        ok = np.zeros(len(names), dtype=bool)
        whole = np.flatnonzero(got == page + TRAILER_BYTES)
        if whole.size:
            pages = stage[:, :page] if whole.size == len(names) else stage[whole, :page]
            trailer = np.ascontiguousarray(stage[whole, page:]).view("<u8")
            sums = page_checksums([names[i].encode() for i in whole], pages)
            ok[whole] = (trailer[:, 0] == TRAILER_MAGIC) & (trailer[:, 1] == sums)
        good = np.flatnonzero(ok)
        start = 0
        for rows in pool.rows:
            rows[slots[good]] = stage[good, start:start + rows.shape[1]]
            start += rows.shape[1]
        return ok
