"""Push mode, prefill side: match decode instances' offers with computed prefills, and write them.

A decode instance that allocated blocks for a request routed in push mode offers them (`wire.Offer`:
the key the router gave both instances, and params naming the blocks, held under the decode's own
lease). The prefill engine says when the request's KV is computed (`ready`). Whichever comes second
starts the WRITE, as a load with op WRITE on the consumer: the handshake, the claim (which pins the
decode's lease), the deadline, the isolation per peer and the done/abort notices are the pull path's.
A prefill that is ready with no offer within `wait_s` gives its blocks back; an offer no prefill
picks up is forgotten when the decode's lease runs out (the decode fails it at its own deadline).

Between TP sizes, every decode rank offers to every prefill rank (`wire.Offer.tp_size`: how many decode
ranks there are); a prefill rank waits for all of a key's offers, combines them into one set of params
naming every decode rank, and its WRITE goes to the decode ranks whose pages take a part of its shard
(`kvconnect.shards.write_plan`), each a part of one load: it is pushed once every part landed. A rank
whose shard no decode rank takes is pushed at once, writing nothing.

Layer-wise (`ready(..., layerwise=True)` before the forward pass that completes the prompt): each
region is posted as soon as `regions_ready` says its layers are computed, so the WRITE runs during
the forward pass; `regions_ready(None)` after it releases the rest.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kvconnect import wire
from kvconnect.descriptors import CheckedIds
from kvconnect.errors import KVConnectError
from kvconnect.pd.consumer import Consumer, LoadResults
from kvconnect.pd.fence import Fence
from kvconnect.pd.producer import combine_ranks
from kvconnect.sidechannel import Refusal


@dataclass
class PushResults:
    """Pushes (by handle) that ended since the last call: every byte landed, or failed with why."""

    pushed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class _Offered:
    """The offers of one key so far, by decode rank, and when to forget them."""

    tp: int
    engine_id: str
    ranks: dict[int, wire.TransferParams]
    until: float

    @property
    def complete(self) -> bool:
        """Every decode rank offered."""
        return len(self.ranks) == self.tp


@dataclass
class _Ready:
    handle: str
    block_ids: tuple[np.ndarray, ...]
    since: float
    timeout_s: float | None
    layerwise: bool = False
    regions: set[int] | None = None  # layer-wise: the regions computed so far (None: all)
    started: bool = False  # its WRITE is a load: later regions go to the consumer directly
    # The engine's stream is past the bytes of `regions` (whole push: of every block) once it passed
    # this fence; a stream runs in order, so the latest fence covers every region before it.
    fence: Fence | None = None


class Pusher:
    """Pairs offers with ready prefills by key and hands each pair to the consumer as a WRITE."""

    def __init__(self, consumer: Consumer, *, wait_s: float = 30.0, max_offers: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        self.consumer = consumer
        self.wait_s = wait_s
        self.max_offers = max_offers
        self._clock = clock
        self._lock = threading.Lock()
        self._offers: dict[str, _Offered] = {}  # key -> the decode ranks' offers so far
        self._ready: dict[str, _Ready] = {}  # key -> the prefill waiting for its offer
        self._writing: dict[str, str] = {}  # handle -> key, while the consumer runs the WRITE
        self._streaming: dict[str, _Ready] = {}  # handle -> layer-wise pushes whose forward pass still runs
        self._results = PushResults()

    # ---- the side channel's thread ----

    def offer(self, msg: wire.Offer) -> None:
        """A decode rank's offer: start the WRITE once the prefill is ready and every decode rank offered,
        else keep it (Refusal if unusable)."""
        params = msg.params
        if params.tp_size != 1 or not 0 <= msg.rank < msg.tp_size:
            raise Refusal("unsupported", f"an offer names one decode rank of its TP size (rank {msg.rank} of "
                          f"{msg.tp_size}, params naming {params.tp_size} ranks)", "unsupported")
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            got = self._offers.get(msg.key)
            if msg.key in self._writing.values() or (got is not None and msg.rank in got.ranks):
                raise Refusal("unsupported", f"key {msg.key!r} was offered already", "unsupported")
            if got is not None and (got.tp, got.engine_id) != (msg.tp_size, params.engine_id):
                raise Refusal("unsupported", f"key {msg.key!r} was offered by {got.engine_id} of TP {got.tp}, now by "
                              f"{params.engine_id} of TP {msg.tp_size}", "unsupported")
            if got is None:
                if len(self._offers) >= self.max_offers:
                    raise Refusal("busy", f"{self.max_offers} offers wait for their prefill already", "busy")
                got = self._offers[msg.key] = _Offered(msg.tp_size, params.engine_id, {}, now + 3600.0)
            ttl = max(0.0, params.lease_expiry - time.time())
            got.ranks[msg.rank] = params
            got.until = min(got.until, now + min(ttl, 3600.0))
            if not got.complete or msg.key not in self._ready:
                return
            del self._offers[msg.key]
            ready = self._ready.pop(msg.key)
        self._start(msg.key, got, ready)

    # ---- the engine's thread ----

    def ready(self, key: str, block_ids: Sequence[Sequence[int]], *, handle: str, timeout_s: float | None = None,
              layerwise: bool = False, fence: Fence | None = None) -> None:
        """The prefill of `key` is computed into these blocks (layer-wise: is being computed, region by region):
        write them once (or as soon as) it is offered, and not before the engine's stream passed `fence`."""
        if not isinstance(key, str) or not 1 <= len(key) <= 128:
            raise KVConnectError(f"push key must be a string of 1 to 128 characters, got {key!r}")
        # Ids the push role checked stay checked: the WRITE's load does not look at them again.
        blocks = tuple(g if isinstance(g, CheckedIds) else np.asarray(g, dtype=np.int64).reshape(-1) for g in block_ids)
        with self._lock:
            if key in self._ready or handle in self._writing:
                raise KVConnectError(f"push {key!r} (handle {handle!r}) is already waiting or writing")
            ready = _Ready(handle, blocks, self._clock(), timeout_s, layerwise, set() if layerwise else None,
                           fence=None if layerwise else fence)
            if layerwise:
                self._streaming[handle] = ready
            offer = self._offers.get(key)
            if offer is None or not offer.complete:
                self._ready[key] = ready
                return
            del self._offers[key]
        self._start(key, offer, ready)

    def regions_ready(self, regions: Sequence[int] | None, fence: Fence | None = None) -> int:
        """Layer-wise: these regions are computed for every push whose forward pass runs (None: it ended),
        once the engine's stream passed `fence`. Returns to how many running WRITEs they went."""
        with self._lock:
            streams = list(self._streaming.values())
            for ready in streams:
                if ready.regions is not None:
                    ready.regions = None if regions is None else ready.regions | set(regions)
                    ready.fence = fence or ready.fence
            if regions is None:
                self._streaming.clear()
            writing = [r.handle for r in streams if r.started]
        for handle in writing:
            self.consumer.regions_ready(handle, regions, fence)
        return len(writing)

    @property
    def streaming(self) -> bool:
        """Whether a layer-wise push waits for regions of the forward pass that runs."""
        with self._lock:
            return bool(self._streaming)

    def abort(self, handle: str) -> bool:
        """Give up a push: reported failed once no WRITE of it can still land; False if unknown here."""
        with self._lock:
            self._streaming.pop(handle, None)
            for key, ready in self._ready.items():
                if ready.handle == handle:
                    del self._ready[key]
                    self._results.failed[handle] = "aborted by the engine before the decode offered its blocks"
                    return True
            writing = handle in self._writing
        if writing:
            self.consumer.abort(handle)
        return writing

    def take(self, loads: LoadResults) -> PushResults:
        """The pushes that ended, taken out of the consumer's results (which keep the pull loads)."""
        with self._lock:
            self._expire_locked(self._clock())
            out, self._results = self._results, PushResults()
            for handle in [h for h in loads.loaded if h in self._writing]:
                loads.loaded.remove(handle)
                del self._writing[handle]
                out.pushed.append(handle)
            for handle in [h for h in loads.failed if h in self._writing]:
                out.failed[handle] = str(loads.failed.pop(handle))
                del self._writing[handle]
        return out

    @property
    def pending(self) -> int:
        """Prefills waiting for their offer, plus WRITEs in flight."""
        with self._lock:
            return len(self._ready) + len(self._writing)

    # ---- helpers ----

    def _start(self, key: str, offer: _Offered, ready: _Ready) -> None:
        try:
            params = combine_ranks([offer.ranks[r] for r in range(offer.tp)])
            local = _suffix(ready.block_ids, params.block_ids)
            with self._lock:
                self._writing[ready.handle] = key
            self.consumer.load(params, local, handle=ready.handle, timeout_s=ready.timeout_s, op="WRITE",
                               layerwise=ready.layerwise, fence=ready.fence)
            if ready.layerwise:
                with self._lock:  # from here on regions_ready forwards; what came before is in the snapshot
                    ready.started, regions, fence = True, ready.regions, ready.fence
                self.consumer.regions_ready(ready.handle, None if regions is None else sorted(regions), fence)
        except (KVConnectError, wire.WireError) as exc:
            with self._lock:
                self._writing.pop(ready.handle, None)
                self._streaming.pop(ready.handle, None)
                self._results.failed[ready.handle] = f"params: {exc}"

    def _expire_locked(self, now: float) -> None:
        for key in [k for k, o in self._offers.items() if o.until <= now]:
            del self._offers[key]
        for key in [k for k, r in self._ready.items() if now - r.since >= self.wait_s]:
            ready = self._ready.pop(key)
            got = self._offers.get(key)
            who = "no decode" if got is None else f"{len(got.ranks)} of {got.tp} decode ranks"
            self._results.failed[ready.handle] = f"{who} offered blocks for push {key!r} within {self.wait_s:g} s"


def _suffix(local: tuple[np.ndarray, ...], remote: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """The prefill's blocks each offered block receives: its last ones (a decode holding a prefix offers fewer)."""
    if len(local) != len(remote):
        raise KVConnectError(f"the prefill has {len(local)} KV groups, the offer {len(remote)}")
    out = []
    for g, (ids, theirs) in enumerate(zip(local, remote)):
        if len(theirs) > ids.size:
            raise KVConnectError(f"group {g}: the decode offers {len(theirs)} blocks, the prefill computed {ids.size}")
        out.append(ids.tail(len(theirs)) if isinstance(ids, CheckedIds) else ids[ids.size - len(theirs):])
    return out
