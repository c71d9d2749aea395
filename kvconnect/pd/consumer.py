"""Consumer (decode) side of the P/D pull protocol: handshake, claim, pull, report.

`load()` only queues; one worker thread does the rest so the engine loop never waits on the network:
it handshakes once per peer (cached; a new incarnation means re-handshake), claims the requests' leases
on the producer (a refused claim fails the load before any byte moves), posts one transfer per peer
and KV group for everything queued for it, polls, and on completion tells the producer it is done.
Every load has a deadline; pending loads send heartbeats; whatever happens is reported by `poll()`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kvconnect import metrics, wire
from kvconnect.errors import BlockRangeError, KVConnectError
from kvconnect.handshake import PeerDirectory, fetch_metadata, send_control
from kvconnect.regions import RegionSet
from kvconnect.transport.base import Transport, TransferState

log = logging.getLogger(__name__)

PeerAddr = tuple[str, str, int]  # engine id, host, port


@dataclass
class LoadResults:
    """What `Consumer.poll()` reports since its previous call."""

    finished: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    invalid_block_ids: list[np.ndarray] = field(default_factory=list)

    def invalid_blocks(self) -> set[int]:
        """The local block ids of every failed load, as one set."""
        return {int(b) for arr in self.invalid_block_ids for b in arr}


@dataclass
class _Load:
    request_id: str
    params: wire.TransferParams
    local: tuple[np.ndarray, ...]
    deadline: float
    remote: tuple[np.ndarray, ...] = ()
    handles: list = field(default_factory=list)
    peer_id: str = ""
    posted_at: float = 0.0


@dataclass
class _Peer:
    peer_id: str
    incarnation: str
    regions: RegionSet
    last_heartbeat: float = 0.0


class Consumer:
    """Pulls finished prefills' KV blocks from producers into local blocks."""

    def __init__(
        self,
        *,
        engine_id: str,
        transport: Transport,
        regions: RegionSet,
        expect: wire.Compat,
        group_regions: Sequence[Sequence[int]] | None = None,
        rank: int = 0,
        secret: bytes | str | None = None,
        load_timeout_s: float = 60.0,
        handshake_timeout_s: float = 5.0,
        heartbeat_s: float = 5.0,
        peer_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine_id = engine_id
        self.transport = transport
        self.regions = regions
        self.expect = expect
        self.group_regions = [list(g) for g in (group_regions or [range(len(regions))])]
        self._group_bytes = [sum(regions[k].block_bytes for k in g) for g in self.group_regions]
        self.rank = rank
        self.secret = secret
        self.load_timeout_s = load_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.heartbeat_s = heartbeat_s
        self._clock = clock
        self._directory = PeerDirectory(ttl_s=peer_ttl_s)
        self._peers: dict[PeerAddr, _Peer] = {}
        self._incoming: queue.SimpleQueue[_Load | str | None] = queue.SimpleQueue()
        self._active: dict[str, _Load] = {}
        self._lock = threading.Lock()
        self._results = LoadResults()
        self._stop = threading.Event()
        self._notifier = Notifier(secret=secret, timeout_s=min(1.0, handshake_timeout_s))
        self._thread = threading.Thread(target=self._run, name="kvconnect-consumer", daemon=True)
        self._thread.start()

    # ---- engine-facing API (any thread) ----

    def load(self, request_id: str, local_block_ids: Sequence[Sequence[int]], params: wire.TransferParams,
             timeout_s: float | None = None) -> None:
        """Queue a pull of `params`' blocks into these local block ids (one list per KV group).

        When a group has fewer local ids than remote ones, only the remote suffix is pulled: the
        consumer already holds the prefix.
        """
        if len(local_block_ids) != len(self.group_regions):
            raise BlockRangeError(f"{len(local_block_ids)} block-id groups given, connector has "
                                  f"{len(self.group_regions)} KV groups")
        local = tuple(self.regions.validate(ids, regions) for ids, regions in zip(local_block_ids, self.group_regions))
        deadline = self._clock() + (self.load_timeout_s if timeout_s is None else timeout_s)
        self._incoming.put(_Load(request_id, params, local, deadline))

    def abort(self, request_id: str) -> None:
        """Give up on a load: it is reported failed and the producer is told to free its blocks."""
        self._incoming.put(request_id)

    def poll(self) -> LoadResults:
        """Loads that finished or failed since the last call."""
        with self._lock:
            out, self._results = self._results, LoadResults()
        return out

    @property
    def pending(self) -> int:
        """Loads queued or in flight."""
        return len(self._active) + self._incoming.qsize()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker: in-flight loads are aborted and reported failed."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._incoming.put(None)
        self._thread.join(timeout)
        self._notifier.close()

    # ---- worker thread ----

    def _run(self) -> None:
        while True:
            busy = bool(self._active)
            try:
                item = self._incoming.get(timeout=0.0005 if busy else 0.05)
            except queue.Empty:
                item = None
            new: list[_Load] = []
            aborts: list[str] = []
            while item is not None or not self._incoming.empty():
                if isinstance(item, _Load):
                    new.append(item)
                elif isinstance(item, str):
                    aborts.append(item)
                try:
                    item = self._incoming.get_nowait()
                except queue.Empty:
                    break
            if self._stop.is_set():
                self._shutdown(new)
                return
            try:
                for rid in aborts:
                    self._abort_one(rid)
                if new:
                    self._start(new)
                self._progress()
                self._heartbeats()
            except Exception:  # the worker must outlive any single bad load
                log.exception("kvconnect consumer: unexpected error; failing in-flight loads")
                for rid in list(self._active):
                    self._fail(rid, "internal", "internal error")

    def _start(self, loads: list[_Load]) -> None:
        by_peer: dict[PeerAddr, list[_Load]] = {}
        for ld in loads:
            if ld.request_id in self._active:
                self._report_failed(ld, "post", "duplicate load for this request id")
                continue
            self._active[ld.request_id] = ld
            p = ld.params
            by_peer.setdefault((p.engine_id, p.host, p.port), []).append(ld)
        for addr, group in by_peer.items():
            self._start_peer(addr, group)

    def _start_peer(self, addr: PeerAddr, loads: list[_Load]) -> None:
        try:
            peer = self._peer(addr, loads[0].params.incarnation)
        except KVConnectError as exc:
            for ld in loads:
                self._fail(ld.request_id, "handshake", f"handshake: {exc}")
            return
        ready: list[_Load] = []
        for ld in loads:
            reason = self._plan(ld, peer)
            if reason:
                self._fail(ld.request_id, "post", reason)
            else:
                ready.append(ld)
        if not ready:
            return
        need = max(0.0, max(ld.deadline for ld in ready) - self._clock())
        granted: list[_Load] = []
        step = wire.MAX_HEARTBEAT_IDS
        for i in range(0, len(ready), step):
            chunk = ready[i:i + step]
            try:
                reply = send_control(addr[1], addr[2], wire.Claim(
                    engine_id=self.engine_id, rank=self.rank, request_ids=tuple(ld.request_id for ld in chunk),
                    need_s=need, incarnation=peer.incarnation), timeout=self.handshake_timeout_s, secret=self.secret)
            except KVConnectError as exc:
                for ld in chunk:
                    self._fail(ld.request_id, "lease", f"claim: {exc}")
                continue
            if reply.incarnation != peer.incarnation:
                # The cached agent is gone with the old process: forget it; the next load re-handshakes.
                self._drop_peer(addr)
            for ld in chunk:
                if ld.request_id in reply.granted:
                    granted.append(ld)
                else:
                    self._fail(ld.request_id, "lease", f"producer refused: {reply.refused.get(ld.request_id, 'no answer')}",
                               notify=False)
        self._post(peer, granted)

    def _plan(self, ld: _Load, peer: _Peer) -> str:
        """Remote ids checked against the peer's regions, suffix-aligned; an error text, or ''."""
        p = ld.params
        if p.incarnation != peer.incarnation:
            return f"producer restarted (incarnation {peer.incarnation}, params from {p.incarnation})"
        if len(p.block_ids) != len(self.group_regions):
            return f"params carry {len(p.block_ids)} KV groups, this connector has {len(self.group_regions)}"
        remote = []
        for g, (local, rids, regions) in enumerate(zip(ld.local, p.block_ids, self.group_regions)):
            if local.size > len(rids):
                return f"group {g}: {local.size} local blocks but the producer holds only {len(rids)}"
            rids = np.asarray(rids[len(rids) - local.size:], dtype=np.int64)
            try:
                remote.append(peer.regions.validate(rids, regions))
            except (BlockRangeError, KVConnectError) as exc:
                return f"remote block ids rejected: {exc}"
        ld.remote = tuple(remote)
        ld.peer_id = peer.peer_id
        return ""

    def _post(self, peer: _Peer, loads: list[_Load]) -> None:
        if not loads:
            return
        for g, regions in enumerate(self.group_regions):
            local = np.concatenate([ld.local[g] for ld in loads])
            remote = np.concatenate([ld.remote[g] for ld in loads])
            if local.size == 0:
                continue
            try:
                handle = self.transport.post("READ", peer.peer_id, local, remote, regions=regions)
            except KVConnectError as exc:
                for ld in loads:
                    self._fail(ld.request_id, "post", f"post: {exc}")
                return
            metrics.transfer_descriptors.labels(self.transport.name).observe(local.size * len(regions))
            shared = _Batch(handle, len(loads))
            for ld in loads:
                ld.handles.append(shared)
        now = time.perf_counter()
        for ld in loads:
            ld.posted_at = now
            if not ld.handles:  # nothing to pull: the consumer already held every block
                self._finish(ld.request_id)

    def _progress(self) -> None:
        now = self._clock()
        for rid, ld in list(self._active.items()):
            states = [batch.state(self.transport) for batch in ld.handles]
            if any(s is TransferState.FAILED for s in states):
                self._fail(rid, "transfer", "transfer failed")
            elif states and all(s is TransferState.DONE for s in states):
                self._finish(rid)
            elif now >= ld.deadline:
                self._fail(rid, "transfer", "load deadline exceeded")

    def _heartbeats(self) -> None:
        now = self._clock()
        by_peer: dict[PeerAddr, list[str]] = {}
        for rid, ld in self._active.items():
            p = ld.params
            by_peer.setdefault((p.engine_id, p.host, p.port), []).append(rid)
        for addr, rids in by_peer.items():
            peer = self._peers.get(addr)
            if peer is None or now - peer.last_heartbeat < self.heartbeat_s:
                continue
            peer.last_heartbeat = now
            for i in range(0, len(rids), wire.MAX_HEARTBEAT_IDS):
                self._notify(addr, wire.Heartbeat(engine_id=self.engine_id, rank=self.rank,
                                                  request_ids=tuple(rids[i:i + wire.MAX_HEARTBEAT_IDS])))

    def _peer(self, addr: PeerAddr, incarnation: str) -> _Peer:
        peer = self._peers.get(addr)
        if peer is not None and peer.incarnation == incarnation and self._directory.get(addr[0], self.rank):
            return peer
        t0 = time.perf_counter()
        meta = fetch_metadata(addr[1], addr[2], rank=self.rank, timeout=self.handshake_timeout_s,
                              secret=self.secret, expect=self.expect)
        metrics.handshake_seconds.observe(time.perf_counter() - t0)
        if meta.engine_id != addr[0]:
            raise KVConnectError(f"peer at {addr[1]}:{addr[2]} is engine {meta.engine_id!r}, expected {addr[0]!r}")
        self._directory.put(meta)
        self._notifier.reset(addr)  # a peer that answers again is reachable again
        if peer is not None:
            self._drop_peer(addr)
        remote_regions = wire.regions_from_wire(meta.regions)
        peer_id = f"{meta.engine_id}/{meta.rank}/{meta.incarnation}"
        self.transport.add_peer(peer_id, meta.transport_metadata, remote_regions)
        peer = _Peer(peer_id, meta.incarnation, remote_regions)
        self._peers[addr] = peer
        return peer

    def _drop_peer(self, addr: PeerAddr) -> None:
        peer = self._peers.pop(addr, None)
        if peer is None:
            return
        self._directory.remove(addr[0], self.rank)
        for rid, ld in list(self._active.items()):
            if ld.peer_id == peer.peer_id:
                self._fail(rid, "lease", "producer restarted", notify=False)
        try:
            self.transport.remove_peer(peer.peer_id)
        except KVConnectError as exc:
            log.warning("kvconnect consumer: removing peer %s failed: %s", peer.peer_id, exc)

    def _abort_one(self, request_id: str) -> None:
        if request_id in self._active:
            self._fail(request_id, "abort", "aborted by the engine")

    def _finish(self, request_id: str) -> None:
        ld = self._active.pop(request_id)
        self._release(ld)
        backend = self.transport.name
        metrics.transfer_bytes.labels(backend).inc(
            sum(ids.size * self._group_bytes[g] for g, ids in enumerate(ld.local)))
        metrics.transfer_seconds.labels(backend).observe(time.perf_counter() - ld.posted_at)
        p = ld.params
        self._notify((p.engine_id, p.host, p.port), wire.Done(engine_id=self.engine_id, rank=self.rank,
                                                              request_ids=(request_id,)))
        with self._lock:
            self._results.finished.append(request_id)

    def _fail(self, request_id: str, stage: str, reason: str, notify: bool = True) -> None:
        ld = self._active.pop(request_id, None)
        if ld is None:
            return
        self._release(ld)
        if notify:
            p = ld.params
            self._notify((p.engine_id, p.host, p.port), wire.Abort(engine_id=self.engine_id, rank=self.rank,
                                                                   request_ids=(request_id,), reason=reason[:1000]))
        self._report_failed(ld, stage, reason)

    def _report_failed(self, ld: _Load, stage: str, reason: str) -> None:
        # One line per failed request, with everything an operator greps for.
        log.warning("kvconnect load failed: request=%s peer=%s@%s:%s stage=%s reason=%s",
                    ld.request_id, ld.params.engine_id, ld.params.host, ld.params.port, stage, reason)
        metrics.failures.labels(stage).inc()
        with self._lock:
            self._results.failed[ld.request_id] = reason
            self._results.invalid_block_ids.extend(ld.local)

    def _release(self, ld: _Load) -> None:
        for batch in ld.handles:
            batch.drop(self.transport)
        ld.handles.clear()

    def _notify(self, addr: PeerAddr, note: wire.Done | wire.Abort | wire.Heartbeat) -> None:
        self._notifier.send(addr, note)

    def _shutdown(self, new: list[_Load]) -> None:
        for ld in new:
            self._report_failed(ld, "shutdown", "consumer closed")
        for rid in list(self._active):
            self._fail(rid, "shutdown", "consumer closed")
        for addr in list(self._peers):
            self._drop_peer(addr)


class _Batch:
    """A posted transfer shared by the loads it carries; released when the last of them lets go."""

    def __init__(self, handle: object, users: int):
        self.handle = handle
        self.users = users
        self._state: TransferState | None = None

    def state(self, transport: Transport) -> TransferState:
        if self._state in (TransferState.DONE, TransferState.FAILED):
            return self._state
        self._state = transport.poll(self.handle)
        return self._state

    def drop(self, transport: Transport) -> None:
        self.users -= 1
        if self.users == 0:
            transport.release(self.handle)


class Notifier:
    """Delivers done/abort/heartbeat notices on its own thread, so a dead producer never stalls pulls.

    A notice that cannot be delivered is dropped with a log line: the producer's lease expiry bounds
    what a lost notice costs. After a failed delivery, notices to that peer are dropped for
    `backoff_s` instead of each waiting out its own timeout.
    """

    def __init__(self, *, secret: bytes | str | None, timeout_s: float = 1.0, backoff_s: float = 5.0):
        self.secret = secret
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.dropped = 0
        self._queue: queue.SimpleQueue[tuple[PeerAddr, object] | None] = queue.SimpleQueue()
        self._down_until: dict[PeerAddr, float] = {}
        self._thread = threading.Thread(target=self._run, name="kvconnect-notifier", daemon=True)
        self._thread.start()

    def send(self, addr: PeerAddr, note: wire.Done | wire.Abort | wire.Heartbeat) -> None:
        """Queue a notice for a producer."""
        self._queue.put((addr, note))

    def reset(self, addr: PeerAddr) -> None:
        """Forget a delivery failure to `addr`: it just answered a handshake."""
        self._down_until.pop(addr, None)

    def close(self, timeout: float = 3.0) -> None:
        """Deliver what is queued (bounded by `timeout`), then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            addr, note = item
            if time.monotonic() < self._down_until.get(addr, 0.0):
                self.dropped += 1
                continue
            try:
                send_control(addr[1], addr[2], note, timeout=self.timeout_s, secret=self.secret)
            except KVConnectError as exc:
                self.dropped += 1
                self._down_until[addr] = time.monotonic() + self.backoff_s
                metrics.failures.labels("notify").inc()
                log.warning("kvconnect notice not delivered: request=%s peer=%s@%s:%s stage=notify reason=%s",
                            ",".join(getattr(note, "request_ids", ())), addr[0], addr[1], addr[2], exc)
            except Exception:  # a notice must never kill the thread that carries all the others
                self.dropped += 1
                log.exception("kvconnect: notice to %s:%s failed", addr[1], addr[2])
