"""The lower tiers in order below the host pool: write-behind copies down, fetches up.

Pages go down when they are stored, not when they are evicted: once a host store is published, its
slots are pinned and copied to every tier by this chain's own thread, then unpinned. Eviction from
the host pool then only drops a slot (its page is already below), so a full pool never waits for a
disk or a network on the store path. The queue of pages waiting to go down is bounded (half the pool
by default); beyond it write-behind is skipped and counted, so pins never fill the pool.

Fetches (promotions) run on the offload connector's job worker, inside the load job that needs them:
each tier in turn is asked for what the ones above it did not return. A tier that raises on a fetch
or a lookup answers "none" for that call: it never fails the load by itself nor hands back a page
it did not verify.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

import numpy as np

from kvconnect.errors import KVConnectError
from kvconnect.offload.tiers.base import PoolView, Tier
from kvconnect.threads import spawn

log = logging.getLogger("kvconnect.offload.tiers")


class TierChain:
    """Tiers below the host pool, first tried first; one thread writes pages down."""

    def __init__(self, tiers: Sequence[Tier], pool: PoolView, max_pending: int | None = None):
        if not tiers:
            raise KVConnectError("a tier chain needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise KVConnectError(f"each tier kind at most once, got {names}")
        self.tiers = list(tiers)
        self.pool = pool
        self.max_pending = max(1, pool.num_slots // 2) if max_pending is None else max_pending
        for tier in self.tiers:
            tier.attach(pool)
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.skipped = 0  # pages not written down because the queue was full
        self.fetch_errors = 0  # tier gets that raised (their pages counted as missed)
        self._closed = False
        self._thread = spawn(self._loop, name="kvconnect-tiers")

    def write_behind(self, keys: Sequence[bytes], slots: np.ndarray, release: Callable[[Sequence[bytes]], None]) -> int:
        """Queue the leading pinned pages that fit for every tier; `release(keys)` unpins them when done.

        Returns how many were queued; the caller unpins the rest at once (a prefix is what a lookup
        can use, so the tail is what is skipped).
        """
        with self._lock:
            n = 0 if self._closed else max(0, min(len(keys), self.max_pending - self._pending))
            self.skipped += len(keys) - n
            self._pending += n
        if n:
            self._queue.put((list(keys[:n]), np.asarray(slots, dtype=np.int64)[:n], release))
        return n

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            keys, slots, release = item
            try:
                for tier in self.tiers:
                    try:
                        tier.put(keys, slots)
                    except Exception:  # noqa: BLE001 - a tier's fault never stops the others
                        log.exception("offload tier %s: put of %d pages failed", tier.name, len(keys))
            finally:
                release(keys)
                with self._lock:
                    self._pending -= len(keys)
                    self._idle.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued page went down (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = end - time.monotonic()
                if left <= 0 or not self._idle.wait(left):
                    return self._pending == 0
        return True

    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        """True per key some tier holds (a fetch still verifies); a tier that raises holds none."""
        found = np.zeros(len(keys), dtype=bool)
        for tier in self.tiers:
            todo = np.flatnonzero(~found)
            if todo.size == 0:
                break
            try:
                found[todo] = tier.contains([keys[i] for i in todo])
            except Exception as exc:  # noqa: BLE001 - a tier's fault is a miss, never the engine's
                log.warning("offload tier %s: lookup of %d pages failed (%s); counted as absent",
                            tier.name, todo.size, exc)
        return found

    def fetch(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        """Read `keys` into pool `slots` from the first tier that has each verified; True per page read.

        A tier that raises returns nothing: its pages count as missed (logged with the tier's name
        and error) and the next tier is asked for them, so the result names exactly the pages that
        some tier read and verified. Slots of pages that are False hold undefined bytes. A slot that a
        tier's abandoned read may still write (the pool's quarantine) is asked of no later tier: its
        page stays missed, never verified and then overwritten.
        """
        slots = np.asarray(slots, dtype=np.int64)
        ok = np.zeros(len(keys), dtype=bool)
        for tier in self.tiers:
            todo = np.flatnonzero(~ok & ~self.pool.quarantine.held(slots))
            if todo.size == 0:
                break
            try:
                got = np.asarray(tier.get([keys[i] for i in todo], slots[todo]), dtype=bool)
                if got.shape != todo.shape:
                    raise KVConnectError(f"answered {got.shape} for {todo.size} pages")
            except Exception as exc:  # noqa: BLE001 - a tier's fault is a miss, never wrong bytes
                with self._lock:
                    self.fetch_errors += 1
                tier._count("missed", int(todo.size))
                log.warning("offload tier %s: get of %d pages failed (%s); counted as missed",
                            tier.name, todo.size, exc, exc_info=exc)
                continue
            ok[todo] = got
        return ok

    def stats(self) -> dict[str, int]:
        """Every tier's counters, prefixed with its name, and the write-behind queue's."""
        out: dict[str, int] = {"tier_write_behind_skipped": self.skipped, "tier_write_behind_pending": self._pending,
                               "tier_fetch_errors": self.fetch_errors}
        for tier in self.tiers:
            out.update(tier.stats().as_dict(f"tier_{tier.name}"))
        return out

    def close(self, timeout: float) -> None:
        """Finish queued write-behind (bounded by `timeout`), stop the thread and close every tier."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(max(0.1, timeout))
        for tier in self.tiers:
            tier.close()
