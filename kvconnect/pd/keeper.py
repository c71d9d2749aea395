"""Keeping producers' leases alive while a decode engine still has to start the load.

A request can wait in a decode engine's queue for longer than a producer's lease (`lease_s`). The
engine hands its transfer params to a `LeaseKeeper` as soon as it sees them; the keeper heartbeats
every producer holding such a request every `heartbeat_s`, all producers at once in one call
(`call_many`), so a dead or stalled producer costs the others nothing. A producer that answers that
it no longer holds a request (expired, released, restarted) ends the keeping of that request: its
load will be refused at the claim, and `lost()` says so early.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.pd.plan import PeerAddr
from kvconnect.sidechannel import Target, call_many
from kvconnect.threads import spawn

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Heartbeats the producers of tracked transfer params on a daemon thread until untracked."""

    def __init__(self, *, engine_id: str, rank: int = 0, secret: bytes | str | None = None,
                 heartbeat_s: float = 5.0, timeout_s: float = 2.0,
                 on_lost: Callable[[str], None] | None = None):
        if not heartbeat_s > 0 or not timeout_s > 0:
            raise KVConnectError("heartbeat_s and timeout_s must be positive")
        self.engine_id, self.rank, self.secret = engine_id, rank, secret
        self.heartbeat_s = heartbeat_s
        self.timeout_s = min(timeout_s, heartbeat_s)
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._tracked: dict[str, tuple[PeerAddr, ...]] = {}  # producer request id -> its producer's ranks
        self._lost: list[str] = []
        self._stop = threading.Event()
        self._thread = spawn(self._run, name="kvconnect-lease-keeper")

    def track(self, params: wire.TransferParams) -> None:
        """Start heartbeating the lease `params` name (idempotent)."""
        with self._lock:
            self._tracked[params.request_id] = tuple(PeerAddr.of(params, r) for r in range(params.tp_size))

    def untrack(self, request_id: str) -> None:
        """Stop heartbeating a producer request id (unknown ids are ignored)."""
        with self._lock:
            self._tracked.pop(request_id, None)

    def lost(self) -> list[str]:
        """Request ids whose producer said it no longer holds them, since the last call."""
        with self._lock:
            out, self._lost = self._lost, []
        return out

    @property
    def tracked(self) -> int:
        """How many request ids are being kept."""
        with self._lock:
            return len(self._tracked)

    def close(self) -> None:
        """Stop the thread (within about one heartbeat timeout)."""
        self._stop.set()
        self._thread.join(self.timeout_s + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.beat()
            except Exception:  # the thread must outlive any one round
                log.exception("kvconnect lease keeper: heartbeat round failed")

    def beat(self) -> None:
        """One heartbeat round to every producer holding a tracked request."""
        with self._lock:
            by_peer: dict[PeerAddr, list[str]] = {}
            for rid, addrs in self._tracked.items():
                for addr in addrs:
                    by_peer.setdefault(addr, []).append(rid)
        targets = [Target(addr.host, addr.port, wire.Heartbeat(engine_id=self.engine_id, rank=self.rank,
                                                                request_ids=tuple(rids[i:i + wire.MAX_IDS_PER_MESSAGE])))
                   for addr, rids in by_peer.items() for i in range(0, len(rids), wire.MAX_IDS_PER_MESSAGE)]
        if not targets:
            return
        log.debug("kvconnect lease keeper: heartbeat to %d producer endpoint(s)", len(targets))
        for target, reply in zip(targets, call_many(targets, timeout=self.timeout_s, secret=self.secret)):
            if isinstance(reply, KVConnectError):
                log.info("kvconnect lease keeper: heartbeat to %s:%s failed: %s", target.host, target.port, reply)
                continue
            gone = set(target.message.request_ids) - set(reply.live)
            with self._lock:
                for rid in gone:
                    if self._tracked.pop(rid, None) is not None:
                        self._lost.append(rid)
            for rid in gone:
                if self._on_lost is not None:
                    self._on_lost(rid)
