"""Consumer (decode) side of the P/D pull protocol: the engine-facing calls, and one worker per producer.

`load()`, `abort()`, `release()` and `poll()` never wait on the network: they check their arguments
(a typed error for anything wrong, nothing queued) and hand the work to the `PeerWorker` of the
producer the params name. One id space: a load claims, reads and releases the producer's lease named
by `params.request_id`; the engine's own id travels only as the load's `handle`, by which the load is
aborted and reported.

With tensor parallelism each rank of a decode engine is one consumer. A load from a producer of
another TP size reads from every producer rank that holds a part of this rank's pages (one part per
producer rank, each on that rank's worker, `kvconnect.shards.rank_plan`): it is loaded once every
part is, and failed as soon as one part fails (the others are aborted, so every rank's lease ends).
Producer ranks no decode rank reads are told to release the request by one decode rank. A WRITE (push)
goes the other way: each peer page must be covered once, so the plan is the peer's (`write_plan`), and
a rank with nothing to write reports its load done at once.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.pd.failure import LoadFailure
from kvconnect.pd.outbox import NoticeSettings
from kvconnect.pd.fence import Fence
from kvconnect.pd.parts import AbortLoad, LoadPart, RegionsReady, ReleaseLease
from kvconnect.pd.peer import PeerWorker
from kvconnect.pd.plan import PeerAddr, local_ids
from kvconnect.regions import RegionSet
from kvconnect.shards import RankPlan, rank_plan, write_plan
from kvconnect.transport.base import Transport

__all__ = ["Consumer", "LoadFailure", "LoadResults"]

# Leases remembered as read (about 100 bytes each): far more than a producer holds at once.
MAX_READ_LEASES = 65536


@dataclass
class _Parts:
    """The parts of one load still running, and its first failure."""

    left: int
    failure: LoadFailure | None = None


@dataclass
class LoadResults:
    """What `Consumer.poll()` reports since its previous call, by load handle."""

    loaded: list[str] = field(default_factory=list)
    failed: dict[str, LoadFailure] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)


class Consumer:
    """Pulls finished prefills' KV blocks from producers into local blocks."""

    def __init__(self, *, engine_id: str, transport: Transport, regions: RegionSet, expect: wire.Compat,
                 group_regions: Sequence[Sequence[int]], rank: int = 0, world_size: int = 1,
                 secret: bytes | str | None = None,
                 load_timeout_s: float = 60.0, handshake_timeout_s: float = 5.0, notice_timeout_s: float = 1.0,
                 notice_retry_s: float = 30.0, peer_idle_s: float = 300.0, max_peers: int = 256,
                 close_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.engine_id = engine_id
        self.transport = transport
        self.regions = regions
        self.expect = expect
        self.group_regions = [list(g) for g in group_regions]
        self.group_bytes = [sum(regions[k].block_bytes for k in g) for g in self.group_regions]
        self.rank = rank
        self.world_size = world_size
        self.secret = secret
        self.load_timeout_s = load_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.notices = NoticeSettings(engine_id=engine_id, rank=rank, secret=secret, timeout_s=notice_timeout_s,
                                      retry_s=notice_retry_s)
        self.peer_idle_s = peer_idle_s
        self.max_peers = max_peers
        self.close_timeout_s = close_timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._workers: dict[tuple[PeerAddr, bool], PeerWorker] = {}  # (endpoint, writes) -> its worker
        self._by_handle: dict[str, list[PeerWorker]] = {}
        self._parts: dict[str, _Parts] = {}
        self._plans: dict[tuple[int, str], RankPlan] = {}
        self._leases: dict[str, str] = {}  # producer request id -> handle of the load using it
        # Leases this consumer read to the end, newest last: a lease is read once. Until the producer
        # hears the done notice it still holds the blocks, and params naming it again (a router's
        # garbled or replayed ones) would read another request's KV into this load's blocks.
        self._read: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._results = LoadResults()
        self._closed = False

    # ---- engine-facing API (any thread; never waits on the network) ----

    def load(self, params: wire.TransferParams, local_block_ids: Sequence[Sequence[int]], *,
             handle: str | None = None, timeout_s: float | None = None, op: str = "READ",
             layerwise: bool = False, fence: Fence | None = None) -> str:
        """Queue a pull of `params`' blocks into these local block ids (one list per KV group); returns the handle.

        A group with fewer local ids than remote ones pulls only the remote suffix (the consumer
        already holds the prefix). Anything wrong with the arguments (TP sizes that cannot map
        included) raises a KVConnectError and queues nothing; everything found later is a reported
        failure. `op="WRITE"` (push mode) writes the local blocks into those the params name instead;
        with `layerwise`, only the regions `regions_ready` names are posted, as they become final.
        `fence` (push from a GPU): nothing is posted before the engine's stream has passed it.
        """
        if op not in ("READ", "WRITE"):
            raise KVConnectError(f"op must be READ or WRITE, got {op!r}")
        _require_params(params)
        handle = params.request_id if handle is None else str(handle)
        local = local_ids(self.regions, self.group_regions, params, local_block_ids)
        timeout = self.load_timeout_s if timeout_s is None else timeout_s
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise KVConnectError(f"timeout_s must be a positive number of seconds, got {timeout!r}")
        plan = self._plan(params.tp_size, op)
        deadline = self.clock() + timeout
        parts = [LoadPart(params=params, handle=handle, local=local, deadline=deadline, peer_rank=p,
                          readers=plan.readers[p], op=op, ready=set() if layerwise else None, fence=fence)
                 for p in plan.reads]
        with self._lock:
            if self._closed:
                raise KVConnectError("the consumer is closed")
            if handle in self._by_handle:
                raise KVConnectError(f"a load with handle {handle!r} is already in flight")
            if params.request_id in self._leases:
                raise KVConnectError(f"producer request {params.request_id!r} is already being read by load "
                                     f"{self._leases[params.request_id]!r}")
            if _lease_key(params) in self._read:
                raise KVConnectError(f"producer request {params.request_id!r} of {params.engine_id} was read by this "
                                     "consumer already (a lease is read once)")
            writes = op == "WRITE"
            workers = [self._worker(PeerAddr.of(params, part.peer_rank), writes) for part in parts]
            releasers = [self._worker(PeerAddr.of(params, p), writes) for p in plan.releases]
            self._by_handle[handle] = workers
            self._parts[handle] = _Parts(left=len(parts))
            self._leases[params.request_id] = handle
            for worker, part in zip(workers, parts):
                worker.inbox.put(part)
            for worker in releasers:
                worker.inbox.put(ReleaseLease(params.request_id, 1))
            if not parts:  # push from a rank whose shard no peer rank takes: nothing to write
                self._forget(LoadPart(params=params, handle=handle, local=local, deadline=deadline))
                self._results.loaded.append(handle)
        return handle

    def abort(self, handle: str) -> None:
        """Give up on a load: reported failed (stage abort) once nothing more can land in its blocks."""
        with self._lock:
            for worker in self._by_handle.get(handle, ()):
                worker.inbox.put(AbortLoad(handle))

    def regions_ready(self, handle: str, regions: Sequence[int] | None, fence: Fence | None = None) -> None:
        """Layer-wise loads: these regions' bytes are final (None: every region's) once the engine's stream
        passed `fence` (None: now); they are posted once claimed."""
        with self._lock:
            for worker in self._by_handle.get(handle, ()):
                worker.inbox.put(RegionsReady(handle, None if regions is None else frozenset(regions), fence))

    def release(self, params: wire.TransferParams) -> None:
        """Tell the producer to free a request's blocks without reading them (the consumer holds them all).

        Each decode rank releases the producer ranks `p` with `p % decode TP == rank`, so every rank of
        the producer hears it once.
        """
        _require_params(params)
        with self._lock:
            if self._closed:
                raise KVConnectError("the consumer is closed")
            if params.request_id in self._leases:
                # The producer would free blocks a READ in flight is still reading.
                raise KVConnectError(f"producer request {params.request_id!r} is being read by load "
                                     f"{self._leases[params.request_id]!r}; abort that load instead")
            for p in range(self.rank, params.tp_size, self.world_size):
                self._worker(PeerAddr.of(params, p)).inbox.put(ReleaseLease(params.request_id, 1))

    def poll(self) -> LoadResults:
        """Loads that finished or failed since the last call."""
        with self._lock:
            out, self._results = self._results, LoadResults()
        return out

    @property
    def pending(self) -> int:
        """Loads queued or in flight."""
        with self._lock:
            return len(self._by_handle)

    def peer_ids(self) -> list[str]:
        """The transport peer ids of the producer ranks this consumer holds a handshake with."""
        with self._lock:
            workers = list(self._workers.values())
        return [w.peer.peer_id for w in workers if w.peer is not None]

    @property
    def peers(self) -> int:
        """Producer endpoints with a worker right now."""
        with self._lock:
            return len(self._workers)

    def close(self) -> None:
        """Stop every worker: in-flight loads are cancelled and reported failed (stage shutdown)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers.values())
        for w in workers:
            w.inbox.put(None)
        deadline = time.monotonic() + self.close_timeout_s + 2.0
        for w in workers:
            w.thread.join(max(0.0, deadline - time.monotonic()))

    # ---- called by the workers ----

    def report_loaded(self, load: LoadPart) -> None:
        """A part of a load finished: every byte of it landed."""
        with self._lock:
            self._part_ended(load, None)

    def report_failed(self, load: LoadPart) -> None:
        """A part of a load failed and nothing more can land from it; its siblings are aborted."""
        with self._lock:
            parts = self._parts.get(load.handle)
            if parts is not None and parts.failure is None and parts.left > 1:
                for worker in self._by_handle.get(load.handle, ()):
                    worker.inbox.put(AbortLoad(load.handle))
            self._part_ended(load, load.failure)

    def _part_ended(self, load: LoadPart, failure: LoadFailure | None) -> None:
        parts = self._parts.get(load.handle)
        if parts is None:  # the load ended already (a late report of an aborted part)
            return
        parts.left -= 1
        parts.failure = parts.failure or failure
        if parts.left > 0:
            return
        self._forget(load)
        if parts.failure is None:
            self._results.loaded.append(load.handle)
            self._read[_lease_key(load.params)] = None
            while len(self._read) > MAX_READ_LEASES:
                self._read.popitem(last=False)
            return
        self._results.failed[load.handle] = parts.failure
        for ids in load.local:
            self._results.invalid_block_ids.update(ids.tolist())

    def retire(self, worker: PeerWorker) -> bool:
        """An idle worker asks to exit; refused when work reached it meanwhile."""
        with self._lock:
            key = (worker.addr, worker.writes)
            if not worker.inbox.empty() or self._workers.get(key) is not worker:
                return False
            del self._workers[key]
            return True

    def _plan(self, peer_tp: int, op: str) -> RankPlan:
        plan = self._plans.get((peer_tp, op))
        if plan is None:
            how = write_plan if op == "WRITE" else rank_plan
            plan = how([s for r in self.regions for s in r.splits], self.world_size, self.rank, peer_tp)
            self._plans[(peer_tp, op)] = plan
        return plan

    def _forget(self, load: LoadPart) -> None:
        self._parts.pop(load.handle, None)
        if self._by_handle.get(load.handle) is not None:
            del self._by_handle[load.handle]
        if self._leases.get(load.request_id) == load.handle:
            del self._leases[load.request_id]

    def _worker(self, addr: PeerAddr, writes: bool = False) -> PeerWorker:
        worker = self._workers.get((addr, writes))
        if worker is None:
            if len(self._workers) >= self.max_peers:
                raise KVConnectError(f"this consumer already talks to {self.max_peers} producers (max_peers); "
                                     f"refusing a load from {addr}")
            worker = self._workers[(addr, writes)] = PeerWorker(self, addr, writes)
        return worker


def _lease_key(params: wire.TransferParams) -> tuple[str, str, str]:
    """A lease, named as only one producer incarnation could name it."""
    return params.engine_id, params.incarnation, params.request_id


def _require_params(params: object) -> None:
    """Params reach the consumer parsed (at the engine edge, once): anything else is a caller's bug."""
    if not isinstance(params, wire.TransferParams):
        raise TypeError(f"expected kvconnect.wire.TransferParams (parse a mapping with "
                        f"wire.transfer_params_from_builtins first), got {type(params).__name__}")
