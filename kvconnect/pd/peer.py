"""One producer, one thread: everything a consumer does with one producer endpoint happens here.

A `PeerWorker` handshakes with its producer (once per incarnation), claims the leases of the loads
queued for it, posts one READ per load and KV group, polls them, and tells the producer when it is
done or gives up. Nothing it waits on can delay another producer's loads: each producer endpoint
(engine id, host, port) has its own worker, its own transport peer id and its own failures. Every
wait is bounded by the time the loads involved have left.

A load that fails while bytes may still be landing in its blocks (an abort, a deadline) is cancelled
at the transport and reported only once the transport says nothing more can land.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvconnect import metrics, wire
from kvconnect.errors import KVConnectError
from kvconnect.pd.plan import PeerAddr, check_peer, remote_ids
from kvconnect.regions import RegionSet
from kvconnect.sidechannel import Target, call, call_many, fetch_metadata
from kvconnect.threads import spawn
from kvconnect.transport.base import TransferState

if TYPE_CHECKING:
    from kvconnect.pd.consumer import Consumer

log = logging.getLogger("kvconnect.pd.consumer")

_peer_ids = itertools.count(1)
_POLL_MIN_S, _POLL_MAX_S = 0.0001, 0.002
_NOTICE_BACKOFF_S = 2.0


@dataclass(frozen=True)
class LoadFailure:
    """Why a load failed: the stage it reached and the cause."""

    stage: str
    reason: str

    def __str__(self) -> str:
        return f"{self.stage}: {self.reason}"

    def __contains__(self, text: str) -> bool:
        return text in str(self)


@dataclass
class Load:
    """One queued or running load: what to read, into which blocks, by when."""

    params: wire.TransferParams
    handle: str
    local: tuple[np.ndarray, ...]
    deadline: float
    remote: tuple[np.ndarray, ...] = ()
    transfers: list = field(default_factory=list)
    read_until: float = math.inf
    posted_at: float = 0.0
    failure: LoadFailure | None = None
    notify: bool = True
    # Which producer rank this part of the load reads, and how many consumer ranks read that rank.
    peer_rank: int = 0
    readers: int = 1
    op: str = "READ"  # WRITE in push mode: the local blocks are written into the peer's
    # Layer-wise push: the regions whose bytes are final and may be posted (None: all of them); the
    # load finishes only once every region was posted and has landed.
    ready: set[int] | None = None
    posted: set[tuple[int, int]] = field(default_factory=set)  # (group, region) already posted

    @property
    def open(self) -> bool:
        """Regions may still become ready: the load cannot finish yet."""
        return self.ready is not None

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def incarnation(self) -> str:
        """The incarnation the producer rank held the request under."""
        return self.params.rank(self.peer_rank).incarnation


@dataclass
class _Peer:
    peer_id: str
    incarnation: str
    regions: RegionSet
    tp: int


class PeerWorker:
    """The thread that serves every load from one producer endpoint."""

    def __init__(self, owner: Consumer, addr: PeerAddr):
        self.owner = owner
        self.addr = addr
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[str, Load] = {}
        self.peer: _Peer | None = None
        self._done: list[tuple[str, int]] = []  # (request id, readers)
        self._aborts: list[tuple[str, str, int]] = []  # (request id, reason, readers)
        self._unsent: list[tuple[float, Target]] = []  # notices to send again, with their give-up time
        self._notices_down_until = 0.0
        self._idle_since = owner.clock()
        self.thread = spawn(self._run, name=f"kvconnect-peer-{addr}")

    # ---- the thread ----

    def _run(self) -> None:
        wait = _POLL_MIN_S
        while True:
            items = self._take(wait if self.active else 0.05)
            if any(item is None for item in items):
                self._shutdown([i for i in items if isinstance(i, Load)])
                return
            try:
                self._step(items)
            except Exception:  # a bug: fail what this peer holds, keep the thread for the next loads
                log.exception("kvconnect consumer: unexpected error with producer %s", self.addr)
                for load in list(self.active.values()):
                    self._fail(load, "internal", "unexpected error (see the log)")
            wait = _POLL_MIN_S if items else min(wait * 2, _POLL_MAX_S)
            if not self.active and not items and not self._unsent \
                    and self.owner.clock() - self._idle_since > self.owner.peer_idle_s:
                if self.owner.retire(self):
                    self._drop_peer()
                    return

    def _take(self, timeout: float) -> list:
        try:
            items = [self.inbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    def _step(self, items: list) -> None:
        new: list[Load] = []
        for item in items:
            if isinstance(item, Load):
                new.append(item)
            elif isinstance(item, tuple) and item[0] == "abort":
                self._abort(item[1], new)
            elif isinstance(item, tuple) and item[0] == "release":
                self._done.append((item[1], item[2]))
            elif isinstance(item, tuple) and item[0] == "regions":
                self._regions_ready(item[1], item[2], new)
        if new:
            self._start(new)
        self._progress()
        self._send_notices()
        if self.active or items:
            self._idle_since = self.owner.clock()

    # ---- starting loads: handshake, plan, claim, post ----

    def _start(self, loads: list[Load]) -> None:
        log.debug("kvconnect consumer: %d load(s) from %s: %s", len(loads), self.addr, [ld.handle for ld in loads])
        for load in loads:
            self.active[load.handle] = load
        loads = self._handshake(loads)
        ready = []
        for load in loads:
            try:
                load.remote = remote_ids(load.params, load.local, self.peer.regions, self.owner.group_regions)
                ready.append(load)
            except KVConnectError as exc:
                self._fail(load, "params", str(exc))
        by_readers: dict[int, list[Load]] = {}
        for load in ready:
            by_readers.setdefault(load.readers, []).append(load)
        for readers, same in by_readers.items():
            for chunk in _chunks(same, wire.MAX_IDS_PER_MESSAGE):
                for load in self._claim(chunk, readers):
                    self._post(load)

    def _handshake(self, loads: list[Load]) -> list[Load]:
        """The loads whose producer incarnation we hold metadata for (handshaking first if needed)."""
        stale = [ld for ld in loads if self.peer is None or ld.incarnation != self.peer.incarnation]
        if stale:
            try:
                self._connect(self._left(stale), stale[0].params.tp_size)
            except (KVConnectError, ValueError) as exc:
                for load in loads:
                    self._fail(load, "handshake", str(exc))
                return []
        out = []
        for load in loads:
            if load.incarnation != self.peer.incarnation:
                self._fail(load, "lease", f"producer restarted (incarnation {self.peer.incarnation}, params from "
                                          f"{load.incarnation})", notify=False)
            elif load.params.tp_size != self.peer.tp:
                self._fail(load, "params", f"params name a producer of TP {load.params.tp_size}, it runs TP "
                                           f"{self.peer.tp}", notify=False)
            else:
                out.append(load)
        return out

    def _connect(self, left: float, peer_tp: int) -> None:
        """Handshake within the loads' remaining time; a producer that cannot be reached fails sooner."""
        if left <= 0:
            raise KVConnectError("load deadline passed before the handshake")
        o = self.owner
        t0 = time.perf_counter()
        meta = fetch_metadata(self.addr.host, self.addr.port, rank=self.addr.rank, timeout=left, secret=o.secret,
                              expect=o.expect, connect_timeout=min(o.handshake_timeout_s, left))
        metrics.handshake_seconds.observe(time.perf_counter() - t0)
        if self.peer is not None and self.peer.incarnation == meta.incarnation:
            return
        regions, slices = check_peer(meta, self.addr, o.regions, o.group_regions, tp=o.world_size, rank=o.rank,
                                     peer_tp=peer_tp)
        peer_id = f"{self.addr}#{next(_peer_ids)}"
        o.transport.add_peer(peer_id, meta.transport_metadata, regions, slices)
        self._drop_peer("producer restarted")
        self.peer = _Peer(peer_id, meta.incarnation, regions, meta.world_size)
        self._notices_down_until = 0.0

    def _claim(self, loads: list[Load], readers: int) -> list[Load]:
        """The loads whose leases the producer pinned for us; the others fail (stage lease)."""
        left = self._left(loads)
        if left <= 0:
            for load in loads:
                self._fail(load, "lease", "load deadline passed before the claim")
            return []
        claim = wire.Claim(engine_id=self.owner.engine_id, rank=self.owner.rank, need_s=min(left, 86400.0),
                           request_ids=tuple(ld.request_id for ld in loads), incarnation=self.peer.incarnation,
                           readers=readers)
        sent_at = self.owner.clock()
        log.debug("kvconnect consumer: claim %s from %s", claim.request_ids, self.addr)
        try:
            reply = call(self.addr.host, self.addr.port, claim, timeout=left, secret=self.owner.secret,
                         connect_timeout=min(self.owner.handshake_timeout_s, left))
        except KVConnectError as exc:
            for load in loads:
                self._fail(load, "lease", f"claim: {exc}")
            return []
        if reply.incarnation != self.peer.incarnation:
            for load in loads:
                self._fail(load, "lease", f"producer restarted (incarnation {reply.incarnation})", notify=False)
            self._drop_peer("producer restarted")
            return []
        granted = []
        for load in loads:
            seconds = reply.granted_s.get(load.request_id)
            if seconds is None:
                why = reply.refused.get(load.request_id, "no answer for this request")
                holder = "producer" if load.op == "READ" else "decode"  # whose lease: in push, the decode's
                self._fail(load, "lease", f"{holder} refused: {why}", notify=False)
            else:
                load.read_until = sent_at + seconds
                granted.append(load)
        return granted

    def _post(self, load: Load) -> None:
        """Post what is ready of a claimed load: every group at once, or (layer-wise) the regions ready so far."""
        transport = self.owner.transport
        try:
            for g, sel in enumerate(self.owner.group_regions):
                # Per (group, region): groups of a hybrid model share regions, each with its own blocks.
                regions = [k for k in sel if (g, k) not in load.posted and (load.ready is None or k in load.ready)]
                if load.local[g].size and regions:
                    load.transfers.append(transport.post(load.op, self.peer.peer_id, load.local[g], load.remote[g],
                                                         regions=regions))
                    metrics.transfer_descriptors.labels(transport.name).observe(load.local[g].size * len(regions))
                load.posted.update((g, k) for k in regions)
        except KVConnectError as exc:
            self._fail(load, "post", str(exc))
            return
        load.posted_at = load.posted_at or time.perf_counter()

    def _regions_ready(self, handle: str, regions: frozenset[int] | None, new: list[Load]) -> None:
        """Layer-wise: more regions of a load are final (None: all); post them if it is claimed already."""
        load = self.active.get(handle) or next((ld for ld in new if ld.handle == handle), None)
        if load is None or load.ready is None or load.failure is not None:
            return
        if regions is None:
            load.ready = None
        else:
            load.ready |= regions
        if load.remote and load.read_until < math.inf:  # claimed: post now
            self._post(load)

    # ---- progress ----

    def _progress(self) -> None:
        now = self.owner.clock()
        for load in list(self.active.values()):
            states = [self.owner.transport.poll(t) for t in load.transfers]
            final = all(s is not TransferState.PENDING for s in states)
            if load.failure is not None:
                if final:
                    self._report_failed(load)
            elif now >= load.deadline:
                self._fail(load, "transfer", "load deadline exceeded")
            elif now >= load.read_until:
                self._fail(load, "transfer", "the producer's claim ran out before the read finished")
            elif TransferState.FAILED in states:
                self._fail(load, "transfer", "transfer failed")
            elif final and not load.open:
                self._finish(load)

    def _left(self, loads: list[Load]) -> float:
        return max(ld.deadline for ld in loads) - self.owner.clock()

    def _finish(self, load: Load) -> None:
        del self.active[load.handle]
        backend = self.owner.transport.name
        if load.transfers:
            metrics.transfer_seconds.labels(backend).observe(time.perf_counter() - load.posted_at)
        self._release(load)
        metrics.transfer_bytes.labels(backend).inc(
            sum(ids.size * self.owner.group_bytes[g] for g, ids in enumerate(load.local)))
        self._done.append((load.request_id, load.readers))
        self.owner.report_loaded(load)

    def _fail(self, load: Load, stage: str, reason: str, notify: bool = True) -> None:
        """Fail a load: cancel its transfers, and report it once nothing more can land in its blocks."""
        if load.failure is not None:
            return
        load.failure, load.notify = LoadFailure(stage, reason), notify
        for t in load.transfers:
            self.owner.transport.cancel(t)
        if all(self.owner.transport.poll(t) is not TransferState.PENDING for t in load.transfers):
            self._report_failed(load)

    def _report_failed(self, load: Load) -> None:
        self.active.pop(load.handle, None)
        self._release(load)
        if load.notify:
            self._aborts.append((load.request_id, load.failure.reason[:1000], load.readers))
        log.warning("kvconnect load failed: request=%s peer=%s stage=%s reason=%s", load.handle, self.addr,
                    load.failure.stage, load.failure.reason)
        metrics.failures.labels(load.failure.stage).inc()
        self.owner.report_failed(load)

    def _release(self, load: Load) -> None:
        for t in load.transfers:
            self.owner.transport.release(t)
        load.transfers.clear()

    def _abort(self, handle: str, new: list[Load]) -> None:
        for load in new:
            if load.handle == handle:
                new.remove(load)
                load.failure = LoadFailure("abort", "aborted by the engine")
                self._report_failed(load)
                return
        load = self.active.get(handle)
        if load is not None:
            self._fail(load, "abort", "aborted by the engine")

    # ---- notices to the producer ----

    def _send_notices(self) -> None:
        # A notice that does not get through is sent again until its give-up time: a producer busy for a
        # moment would otherwise hold the blocks until their lease ran out. While the producer does not
        # answer, new notices wait with the others instead of each paying the connect timeout.
        o = self.owner
        now = o.clock()
        if not (self._done or self._aborts or self._unsent) or now < self._notices_down_until:
            return
        done, aborts = self._done, self._aborts
        self._done, self._aborts = [], []
        targets = [Target(self.addr.host, self.addr.port, wire.Done(
            engine_id=o.engine_id, rank=o.rank, request_ids=tuple(rid for rid, _ in chunk), readers=chunk[0][1]))
            for same in _by_last(done) for chunk in _chunks(same, wire.MAX_IDS_PER_MESSAGE)]
        targets += [Target(self.addr.host, self.addr.port, wire.Abort(
            engine_id=o.engine_id, rank=o.rank, request_ids=tuple(rid for rid, _, _ in chunk), reason=chunk[0][1],
            readers=chunk[0][2])) for same in _by_last(aborts) for chunk in _chunks(same, wire.MAX_IDS_PER_MESSAGE)]
        retries = len(self._unsent)
        pending = self._unsent + [(now + o.notice_retry_s, t) for t in targets]
        self._unsent = []
        results = call_many([t for _, t in pending], timeout=o.notice_timeout_s, secret=o.secret)
        for i, ((give_up, target), result) in enumerate(zip(pending, results)):
            if not isinstance(result, KVConnectError):
                continue
            ids = ",".join(target.message.request_ids)
            self._notices_down_until = o.clock() + _NOTICE_BACKOFF_S
            if o.clock() < give_up:
                if i >= retries:
                    log.info("kvconnect consumer: notice for %s to %s not delivered (%s); retrying for %.0f s",
                             ids, self.addr, result, o.notice_retry_s)
                self._unsent.append((give_up, target))
                continue
            metrics.failures.labels("notify").inc()
            log.warning("kvconnect notice not delivered: request=%s peer=%s stage=notify reason=%s", ids,
                        self.addr, result)

    # ---- peer state and shutdown ----

    def _drop_peer(self, why: str = "consumer closed") -> None:
        peer, self.peer = self.peer, None
        if peer is None:
            return
        for load in list(self.active.values()):
            if load.transfers:
                self._fail(load, "lease", why, notify=False)
        try:
            self.owner.transport.remove_peer(peer.peer_id)
        except KVConnectError as exc:
            log.warning("kvconnect consumer: removing peer %s failed: %s", peer.peer_id, exc)

    def _shutdown(self, queued: list[Load]) -> None:
        for load in queued:
            load.failure = LoadFailure("shutdown", "consumer closed")
            self._report_failed(load)
        for load in list(self.active.values()):
            self._fail(load, "shutdown", "consumer closed")
        # Bounded: a transport that cannot recall a batch finishes it within its own deadline.
        deadline = time.monotonic() + self.owner.close_timeout_s
        while self.active and time.monotonic() < deadline:
            self._progress()
            time.sleep(_POLL_MAX_S)
        for load in list(self.active.values()):
            log.warning("kvconnect consumer: %s may still be receiving bytes at shutdown", load.handle)
            self._report_failed(load)
        self._drop_peer()
        self._send_notices()


def _by_last(items: list[tuple]) -> list[list[tuple]]:
    """Items grouped by their last field (the readers count a notice carries for all its ids)."""
    groups: dict[object, list[tuple]] = {}
    for item in items:
        groups.setdefault(item[-1], []).append(item)
    return list(groups.values())


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]
