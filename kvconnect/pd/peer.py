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
from dataclasses import dataclass

from kvconnect import metrics, wire
from kvconnect.errors import KVConnectError, PeerRestarted
from kvconnect.pd.failure import LoadFailure, Stage
from kvconnect.pd.outbox import Outbox, chunks
from kvconnect.pd.fence import Fence
from kvconnect.pd.parts import AbortLoad, LoadPart, Owner, RegionsReady, ReleaseLease
from kvconnect.pd.plan import PeerAddr, check_peer, selections
from kvconnect.regions import RegionSet
from kvconnect.sidechannel import call, fetch_metadata
from kvconnect.threads import spawn
from kvconnect.transport.base import TransferState


log = logging.getLogger("kvconnect.pd.peer")
_RESTARTED = PeerRestarted.kind  # a producer of another incarnation answered

_peer_ids = itertools.count(1)
_POLL_MIN_S, _POLL_MAX_S = 0.0001, 0.002


@dataclass
class _Peer:
    peer_id: str
    incarnation: str
    regions: RegionSet
    tp: int


class PeerWorker:
    """The thread that serves every load from one producer endpoint."""

    def __init__(self, owner: Owner, addr: PeerAddr, writes: bool = False):
        self.owner = owner
        self.addr = addr
        # WRITEs (push) and READs of one producer endpoint have workers of their own: between TP sizes
        # the two directions pair the pages differently.
        self.writes = writes
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[str, LoadPart] = {}
        self.peer: _Peer | None = None
        self.outbox = Outbox(addr.host, addr.port, str(addr), owner.notices, owner.clock)
        self._idle_since = owner.clock()
        self.thread = spawn(self._run, name=f"kvconnect-peer-{addr}")

    # ---- the thread ----

    def _run(self) -> None:
        wait = _POLL_MIN_S
        while True:
            items = self._take(wait if self.active else 0.05)
            if any(item is None for item in items):
                self._shutdown([i for i in items if isinstance(i, LoadPart)])
                return
            try:
                self._step(items)
            except Exception:  # a bug: fail what this peer holds, keep the thread for the next loads
                log.exception("kvconnect consumer: unexpected error with producer %s", self.addr)
                for load in list(self.active.values()):
                    self._fail(load, Stage.INTERNAL, "unexpected error (see the log)")
            wait = _POLL_MIN_S if items else min(wait * 2, _POLL_MAX_S)
            if not self.active and not items and not self.outbox.retrying \
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
        new: list[LoadPart] = []
        for item in items:
            if isinstance(item, LoadPart):
                new.append(item)
            elif isinstance(item, AbortLoad):
                self._abort(item.handle, new)
            elif isinstance(item, ReleaseLease):
                self.outbox.done(item.request_id, item.readers)
            elif isinstance(item, RegionsReady):
                self._regions_ready(item.handle, item.regions, item.fence, new)
        if new:
            self._start(new)
        self._progress()
        self.outbox.send()
        if self.active or items:
            self._idle_since = self.owner.clock()

    # ---- starting loads: handshake, plan, claim, post ----

    def _start(self, loads: list[LoadPart]) -> None:
        log.debug("kvconnect consumer: %d load(s) from %s: %s", len(loads), self.addr, [ld.handle for ld in loads])
        for load in loads:
            self.active[load.handle] = load
        loads = self._handshake(loads)
        ready = []
        for load in loads:
            try:
                # Checked once per (load, group); later posts of it (layer-wise) only narrow the regions.
                load.remote = selections(load.op, load.params, self.owner.regions, load.local, self.peer.regions,
                                         self.owner.group_regions)
                ready.append(load)
            except KVConnectError as exc:
                self._fail(load, Stage.PARAMS, exc)
        by_readers: dict[int, list[LoadPart]] = {}
        for load in ready:
            by_readers.setdefault(load.readers, []).append(load)
        for readers, same in by_readers.items():
            for chunk in chunks(same, wire.MAX_IDS_PER_MESSAGE):
                for load in self._claim(chunk, readers):
                    self._post(load)

    def _handshake(self, loads: list[LoadPart]) -> list[LoadPart]:
        """The loads whose producer incarnation we hold metadata for (handshaking first if needed)."""
        stale = [ld for ld in loads if self.peer is None or ld.incarnation != self.peer.incarnation]
        if stale:
            try:
                self._connect(self._left(stale), stale[0].params.tp_size, self.writes)
            except (KVConnectError, ValueError) as exc:
                for load in loads:
                    self._fail(load, Stage.HANDSHAKE, exc)
                return []
        out = []
        for load in loads:
            if load.incarnation != self.peer.incarnation:
                self._fail(load, Stage.LEASE, f"producer restarted (incarnation {self.peer.incarnation}, params from "
                                          f"{load.incarnation})", notify=False, kind=_RESTARTED)
            elif load.params.tp_size != self.peer.tp:
                self._fail(load, Stage.PARAMS, f"params name a producer of TP {load.params.tp_size}, it runs TP "
                                           f"{self.peer.tp}", notify=False)
            else:
                out.append(load)
        return out

    def _connect(self, left: float, peer_tp: int, write: bool) -> None:
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
        pairing = check_peer(meta, self.addr, o.regions, o.group_regions, tp=o.world_size, rank=o.rank,
                             peer_tp=peer_tp, write=write)
        peer_id = f"{self.addr}#{next(_peer_ids)}"
        o.transport.add_peer(peer_id, meta.transport_metadata, pairing)  # checked above: taken as it is
        self._drop_peer("producer restarted", kind=_RESTARTED)
        self.peer = _Peer(peer_id, meta.incarnation, pairing.remote, meta.world_size)
        self.outbox.reachable()

    def _claim(self, loads: list[LoadPart], readers: int) -> list[LoadPart]:
        """The loads whose leases the producer pinned for us; the others fail (stage lease)."""
        left = self._left(loads)
        if left <= 0:
            for load in loads:
                self._fail(load, Stage.LEASE, "load deadline passed before the claim")
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
                self._fail(load, Stage.LEASE, f"claim: {exc}")
            return []
        if reply.incarnation != self.peer.incarnation:
            for load in loads:
                self._fail(load, Stage.LEASE, f"producer restarted (incarnation {reply.incarnation})", notify=False,
                           kind=_RESTARTED)
            self._drop_peer("producer restarted", kind=_RESTARTED)
            return []
        granted = []
        for load in loads:
            seconds = reply.granted_s.get(load.request_id)
            if seconds is None:
                why = reply.refused.get(load.request_id, "no answer for this request")
                holder = "producer" if load.op == "READ" else "decode"  # whose lease: in push, the decode's
                self._fail(load, Stage.LEASE, f"{holder} refused: {why}", notify=False)
            else:
                load.read_until = sent_at + seconds
                granted.append(load)
        return granted

    def _post(self, load: LoadPart) -> None:
        """Post what is ready of a claimed load: every group at once, or (layer-wise) the regions ready so far."""
        if load.fence is not None:
            if not self._passed(load, load.fence):
                return  # the engine is still computing these blocks: posted by _progress once it is done
            load.fence = None
        transport = self.owner.transport
        try:
            for g, sel in enumerate(self.owner.group_regions):
                # Per (group, region): groups of a hybrid model share regions, each with its own blocks.
                regions = [k for k in sel if (g, k) not in load.posted and (load.ready is None or k in load.ready)]
                if load.local[g].size and regions:
                    load.transfers.append(transport.post(load.remote[g].only(regions), self.peer.peer_id))
                    metrics.transfer_descriptors.labels(transport.name).observe(load.local[g].size * len(regions))
                load.posted.update((g, k) for k in regions)
        except KVConnectError as exc:
            self._fail(load, Stage.POST, exc)
            return
        load.posted_at = load.posted_at or time.perf_counter()

    def _regions_ready(self, handle: str, regions: frozenset[int] | None, fence: Fence | None,
                       new: list[LoadPart]) -> None:
        """Layer-wise: more regions of a load are final (None: all) once the engine's stream passed `fence`."""
        load = self.active.get(handle) or next((ld for ld in new if ld.handle == handle), None)
        if load is None or load.ready is None or load.failure is not None:
            return
        if load.fenced or (fence is not None and not self._passed(load, fence)):
            load.fenced.append((regions, fence))  # in order: a later region never overtakes an earlier one
            return
        self._ready_now(load, regions)

    def _ready_now(self, load: LoadPart, regions: frozenset[int] | None) -> None:
        """These regions' bytes are final: post them if the load is claimed already."""
        if load.ready is None:
            return
        if regions is None:
            load.ready = None
        else:
            load.ready |= regions
        if load.remote and load.read_until < math.inf:  # claimed: post now
            self._post(load)

    # ---- progress ----

    def _passed(self, load: LoadPart, fence: Fence | None) -> bool:
        """Whether the engine's stream passed `fence`; a stream that failed fails the load."""
        try:
            return fence is None or bool(fence.query())
        except Exception as exc:  # a CUDA error: the bytes will never be final
            self._fail(load, Stage.POST, f"the engine's compute stream failed: {type(exc).__name__}: {exc}")
            return False

    def _fences(self, load: LoadPart) -> None:
        """Release what waited for fences the engine's stream has passed since the last step."""
        while load.fenced and load.failure is None and self._passed(load, load.fenced[0][1]):
            self._ready_now(load, load.fenced.pop(0)[0])
        if load.fence is not None and load.failure is None and load.remote and load.read_until < math.inf:
            self._post(load)

    def _progress(self) -> None:
        now = self.owner.clock()
        for load in list(self.active.values()):
            if load.fence is not None or load.fenced:
                self._fences(load)
            states = [self.owner.transport.poll(t) for t in load.transfers]
            final = all(s is not TransferState.PENDING for s in states)
            if load.failure is not None:
                if final:
                    self._report_failed(load)
            elif now >= load.deadline:
                self._fail(load, Stage.TRANSFER, "load deadline exceeded")
            elif now >= load.read_until:
                self._fail(load, Stage.TRANSFER, "the producer's claim ran out before the read finished")
            elif TransferState.FAILED in states:
                failed = load.transfers[states.index(TransferState.FAILED)]
                self._fail(load, Stage.TRANSFER, "transfer failed", kind=self.owner.transport.failure_kind(failed))
            elif final and not load.open:
                self._finish(load)

    def _left(self, loads: list[LoadPart]) -> float:
        return max(ld.deadline for ld in loads) - self.owner.clock()

    def _finish(self, load: LoadPart) -> None:
        del self.active[load.handle]
        backend = self.owner.transport.name
        if load.transfers:
            metrics.transfer_seconds.labels(backend).observe(time.perf_counter() - load.posted_at)
        self._release(load)
        metrics.transfer_bytes.labels(backend).inc(
            sum(ids.size * self.owner.group_bytes[g] for g, ids in enumerate(load.local)))
        self.outbox.done(load.request_id, load.readers)
        self.owner.report_loaded(load)

    def _fail(self, load: LoadPart, stage: Stage, reason: str | KVConnectError, notify: bool = True,
              kind: str = "") -> None:
        """Fail a load: cancel its transfers, and report it once nothing more can land in its blocks."""
        if load.failure is not None:
            return
        failure = LoadFailure.of(stage, reason) if isinstance(reason, KVConnectError) else \
            LoadFailure(stage, reason, kind)
        load.failure, load.notify = failure, notify
        for t in load.transfers:
            self.owner.transport.cancel(t)
        if all(self.owner.transport.poll(t) is not TransferState.PENDING for t in load.transfers):
            self._report_failed(load)

    def _report_failed(self, load: LoadPart) -> None:
        self.active.pop(load.handle, None)
        self._release(load)
        if load.notify:
            self.outbox.abort(load.request_id, load.failure.reason, load.readers)
        kind = load.failure.kind
        log.warning("kvconnect load failed: request=%s peer=%s stage=%s%s reason=%s", load.handle, self.addr,
                    load.failure.stage.value, f" kind={kind}" if kind else "", load.failure.reason)
        metrics.failures.labels(load.failure.stage.value).inc()
        if kind:
            metrics.transfer_errors.labels(kind).inc()
        self.owner.report_failed(load)

    def _release(self, load: LoadPart) -> None:
        for t in load.transfers:
            self.owner.transport.release(t)
        load.transfers.clear()

    def _abort(self, handle: str, new: list[LoadPart]) -> None:
        for load in new:
            if load.handle == handle:
                new.remove(load)
                load.failure = LoadFailure(Stage.ABORT, "aborted by the engine")
                self._report_failed(load)
                return
        load = self.active.get(handle)
        if load is not None:
            self._fail(load, Stage.ABORT, "aborted by the engine")

    # ---- peer state and shutdown ----

    def _drop_peer(self, why: str = "consumer closed", kind: str = "") -> None:
        peer, self.peer = self.peer, None
        if peer is None:
            return
        for load in list(self.active.values()):
            if load.transfers:
                self._fail(load, Stage.LEASE, why, notify=False, kind=kind)
        try:
            self.owner.transport.remove_peer(peer.peer_id)
        except KVConnectError as exc:
            log.warning("kvconnect consumer: removing peer %s failed: %s", peer.peer_id, exc)

    def _shutdown(self, queued: list[LoadPart]) -> None:
        for load in queued:
            load.failure = LoadFailure(Stage.SHUTDOWN, "consumer closed")
            self._report_failed(load)
        for load in list(self.active.values()):
            self._fail(load, Stage.SHUTDOWN, "consumer closed")
        # Bounded: a transport that cannot recall a batch finishes it within its own deadline.
        deadline = time.monotonic() + self.owner.close_timeout_s
        while self.active and time.monotonic() < deadline:
            self._progress()
            time.sleep(_POLL_MAX_S)
        for load in list(self.active.values()):
            log.warning("kvconnect consumer: %s may still be receiving bytes at shutdown", load.handle)
            self._report_failed(load)
        self._drop_peer()
        self.outbox.send()

