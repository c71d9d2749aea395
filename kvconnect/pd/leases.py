"""Producer-side lease table: which finished prefills still hold their KV blocks, and until when.

Pure bookkeeping, no I/O: the producer feeds it holds, claims, heartbeats, done/abort notices and the
clock, and drains the releases to report the blocks to the engine as free. Every lease ends exactly
once, by done, abort or expiry. A lease read by several consumer ranks (a decode instance of another
TP size) ends once as many distinct ranks as the notices say read it have each said done or abort:
until then one of them may still be reading.

A claimed lease never ends under its claim: the engine giving it up while a claim runs (an abort)
ends it when the claimant says done or abort, or `quiesce_s` after the claim ran out, whichever is
first. In push mode the claimant writes into the holder's blocks, so this is what keeps a WRITE in
flight from landing in blocks the engine already reused.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np


_MAX_ENDED = 65536


class ReleaseReason(str, enum.Enum):
    """Why a lease ended."""

    DONE = "done"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass
class Lease:
    """Blocks one request holds for consumers to read."""

    request_id: str
    block_ids: tuple[np.ndarray, ...]
    num_tokens: int
    expires_at: float
    readers: int = 1
    finished: set = field(default_factory=set)  # consumer ranks that said done or abort
    claimants: set = field(default_factory=set)  # consumer ranks that claimed it (when they said who)
    aborted: bool = False
    claimed_until: float = 0.0
    closing: bool = False  # the engine gave it up while claimed: it ends when the claim is over
    hard_until: float = float("inf")  # a deadline no claim or heartbeat extends (push mode's decode)
    lease_s: float = 0.0  # what it was held for (the table's default or the holder's own)


@dataclass(frozen=True)
class LeaseEnd:
    """A lease that ended, and the blocks it gives back."""

    request_id: str
    reason: ReleaseReason
    block_ids: tuple[np.ndarray, ...]
    lease_s: float = 0.0  # the lease's length, for the log line of an expiry


class LeaseTable:
    """Leases by request id; thread-safe, since side-channel threads and the engine loop both touch it."""

    def __init__(self, lease_s: float = 30.0, max_claim_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[int, LeaseEnd | None], None] | None = None, quiesce_s: float = 0.0):
        """`on_change(delta, release)` hears of every lease started (+1, None) and ended (-1, release)."""
        if lease_s <= 0 or max_claim_s <= 0 or quiesce_s < 0:
            raise ValueError("lease_s and max_claim_s must be positive, quiesce_s not negative")
        self.lease_s = lease_s
        self.max_claim_s = max_claim_s
        self.quiesce_s = quiesce_s
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._released: list[LeaseEnd] = []
        # Ended ids are remembered for a while so a late claim is refused with the real reason.
        self._ended: dict[str, tuple[ReleaseReason, float]] = {}

    def hold(self, request_id: str, block_ids: Sequence[Sequence[int]] | Sequence[np.ndarray],
             num_tokens: int, lease_s: float | None = None, hard: bool = False, readers: int = 1) -> Lease:
        """Start a lease (of `lease_s`, default the table's; `hard`: claims and heartbeats never extend it;
        `readers`: at least that many ranks must say done or abort); a request id already held is an error."""
        groups = tuple(np.asarray(g, dtype=np.int64).reshape(-1) for g in block_ids)
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds blocks")
            self._ended.pop(request_id, None)
            length = lease_s or self.lease_s
            lease = Lease(request_id, groups, int(num_tokens), self._clock() + length, readers=max(1, int(readers)),
                          lease_s=length)
            if hard:
                lease.hard_until = lease.expires_at
            self._leases[request_id] = lease
        if self._on_change:
            self._on_change(1, None)
        return lease

    def claim(self, request_ids: Iterable[str], need_s: float, readers: int = 1,
              claimant: object = None) -> tuple[dict[str, float], dict[str, str]]:
        """Pin live leases for a read lasting up to `need_s` (at most `max_claim_s`) by one of `readers` ranks
        (`claimant`, when named: which one, so that a lease given up ends once every claimant finished).

        Returns (granted: seconds from now the lease is pinned for, refused: reason).
        """
        granted: dict[str, float] = {}
        refused: dict[str, str] = {}
        now = self._clock()
        until = now + min(max(need_s, 0.0), self.max_claim_s)
        with self._lock:
            self._expire_locked(now)
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is None or lease.closing:
                    ended = self._ended.get(rid)
                    refused[rid] = "lease aborted" if lease else f"lease {ended[0].value}" if ended else "unknown request"
                    continue
                pinned = min(until, lease.hard_until)
                granted[rid] = max(min(lease.expires_at, lease.hard_until), pinned) - now
                lease.claimed_until = max(lease.claimed_until, pinned)
                lease.expires_at = max(lease.expires_at, pinned + self.quiesce_s)
                lease.readers = max(lease.readers, readers)
                if claimant is not None:
                    lease.claimants.add(claimant)
        return granted, refused

    def heartbeat(self, request_ids: Iterable[str]) -> list[str]:
        """Extend the leases of the named live requests by `lease_s`; returns the ids that are live."""
        now = self._clock()
        live = []
        with self._lock:
            self._expire_locked(now)
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is not None and not lease.closing:
                    lease.expires_at = max(lease.expires_at, min(now + self.lease_s, lease.hard_until))
                    live.append(rid)
        return live

    def release(self, request_id: str, reason: ReleaseReason, reader: object = None, readers: int = 1) -> bool:
        """End a lease (done or abort); False if it had already ended or never existed.

        With `reader` (a consumer rank), the lease ends once `readers` distinct readers released it.
        """
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            now = self._clock()
            # Given up, and every rank that claimed it said done or abort: none can read or write it any
            # more (a closing lease refuses claims), so it need not wait for its claims to run out.
            settled = bool(lease.claimants) and lease.claimants <= (lease.finished | {reader})
            if reader is None and lease.claimed_until > now and not settled:
                lease.closing = True
                lease.expires_at = lease.claimed_until + self.quiesce_s
                return True
            if reader is not None:
                lease.readers = max(lease.readers, readers)
                lease.finished.add(reader)
                lease.aborted |= reason is ReleaseReason.ABORTED
                if len(lease.finished) < lease.readers and not (lease.closing and settled):
                    return True
                reason = ReleaseReason.ABORTED if lease.aborted or lease.closing else reason
            return self._end_locked(request_id, reason, now)

    def expire(self) -> int:
        """End every lease whose time is up; returns how many ended."""
        with self._lock:
            return self._expire_locked(self._clock())

    def drain_released(self) -> list[LeaseEnd]:
        """Leases that ended since the last call, each reported once."""
        with self._lock:
            self._expire_locked(self._clock())
            out, self._released = self._released, []
            return out

    @property
    def held_blocks(self) -> int:
        """How many block ids live leases hold, all groups counted."""
        with self._lock:
            return sum(int(g.size) for lease in self._leases.values() for g in lease.block_ids)

    def _end_locked(self, request_id: str, reason: ReleaseReason, now: float) -> bool:
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        release = LeaseEnd(request_id, reason, lease.block_ids, lease.lease_s)
        self._released.append(release)
        self._ended[request_id] = (reason, now)
        if self._on_change:
            self._on_change(-1, release)
        return True

    def _expire_locked(self, now: float) -> int:
        due = [(rid, lease.closing) for rid, lease in self._leases.items() if lease.expires_at <= now]
        for rid, closing in due:
            self._end_locked(rid, ReleaseReason.ABORTED if closing else ReleaseReason.EXPIRED, now)
        if len(self._ended) > _MAX_ENDED:
            # Oldest first (dicts keep insertion order): forget the longest-ended ids.
            for rid in list(self._ended)[: len(self._ended) - _MAX_ENDED]:
                del self._ended[rid]
        return len(due)


def __getattr__(name: str) -> object:
    if name == "Release":
        raise AttributeError("kvconnect.pd.leases.Release was renamed LeaseEnd")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
