"""Push mode, decode side: offer the blocks allocated for a request to its prefill, and wait for the WRITE.

The blocks are held under a lease in this instance's own producer, and that lease is the deadline
(a hard one: no claim pins it past that time): the prefill's claim pins it while the WRITE runs
(and `quiesce_s` past the claim, so neither an abort nor the deadline frees blocks a WRITE may still
land in), the prefill's done notice ends it as loaded, its abort or
the expiry as failed. Offers are sent from one thread, every pending one at once (`call_many`), so a
dead or slow prefill costs the others nothing; an offer that fails ends its hold at once.

Between TP sizes: the router names the prefill's TP size with its address (rank p listens on port + p),
and every decode rank offers its blocks to every prefill rank, saying its own TP size; a prefill rank
writes once it holds the offers of all decode ranks (`Pusher`). Each decode rank's lease expects as many
writers as prefill ranks hold parts of its pages (`kvconnect.shards.rank_plan`), so it ends as loaded
only once each of them said done, as failed once each said done or abort with one abort among them, or
at its deadline (a prefill rank that died never says either), never while one may still write.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Sequence

from kvconnect import wire
from kvconnect.errors import KVConnectError, TransferError
from kvconnect.pd.leases import LeaseEnd, ReleaseReason
from kvconnect.pd.failure import LoadFailure, Stage
from kvconnect.pd.producer import Producer
from kvconnect.shards import rank_plan
from kvconnect.sidechannel import Target, call_many
from kvconnect.threads import spawn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillAddr:
    """Where the prefill instance of a pushed request listens: rank 0 at `port`, rank p at `port + p`."""

    host: str
    port: int
    tp_size: int = 1


class Offers:
    """The decode's pushes in flight: their holds, the offers still to send, and why any failed."""

    def __init__(self, producer: Producer, *, engine_id: str, rank: int = 0, world_size: int = 1,
                 secret: bytes | str | None = None, timeout_s: float = 5.0):
        self.producer = producer
        self.engine_id, self.rank, self.world_size = engine_id, rank, world_size
        self.secret = secret
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._expected: dict[str, str] = {}  # handle -> push key
        self._why: dict[str, LoadFailure] = {}  # handle -> why its push failed, when known before the release
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = spawn(self._run, name="kvconnect-offers")

    def expect(self, key: str, prefill: PrefillAddr, block_ids: Sequence[Sequence[int]], num_tokens: int, *,
               handle: str, timeout_s: float) -> None:
        """Hold these blocks for `timeout_s` and offer them to the prefill of `key`; never waits on the network."""
        if not isinstance(prefill.tp_size, int) or not 1 <= prefill.tp_size <= wire.MAX_TP:
            raise KVConnectError(f"prefill TP size must be 1 to {wire.MAX_TP}, got {prefill.tp_size!r}")
        if not 0 < prefill.port + prefill.tp_size - 1 <= 65535:
            raise KVConnectError(f"prefill ranks at ports {prefill.port} to {prefill.port + prefill.tp_size - 1} "
                                 "are out of range")
        # Raises HandshakeError (a KVConnectError) when the two TP sizes cannot map.
        writers = len(rank_plan([s for r in self.producer.regions for s in r.splits], self.world_size, self.rank,
                                prefill.tp_size).reads)
        if not isinstance(key, str) or not 1 <= len(key) <= 128:
            raise KVConnectError(f"push key must be a string of 1 to 128 characters, got {key!r}")
        with self._lock:
            if handle in self._expected:
                raise KVConnectError(f"a push with handle {handle!r} is already expected")
            params = self.producer.hold(handle, block_ids, num_tokens, lease_s=timeout_s, hard=True, readers=writers)
            self._expected[handle] = key
        offer = wire.Offer(engine_id=self.engine_id, rank=self.rank, key=key, params=params, tp_size=self.world_size)
        for p in range(prefill.tp_size):
            self._outbox.put(Target(prefill.host, prefill.port + p, offer))

    def take(self, releases: list[LeaseEnd], loaded: list[str], failed: dict[str, LoadFailure],
             invalid: set[int]) -> list[LeaseEnd]:
        """Sort the producer's releases: pushes that landed into `loaded`, pushes that failed into `failed`
        (their blocks into `invalid`); returns the others (pull leases)."""
        rest = []
        with self._lock:
            for rel in releases:
                key = self._expected.pop(rel.request_id, None)
                why = self._why.pop(rel.request_id, None)
                claimant = self.producer.abort_reason(rel.request_id)
                if key is None:
                    rest.append(rel)
                elif rel.reason is ReleaseReason.DONE:
                    loaded.append(rel.request_id)
                else:
                    failed[rel.request_id] = why or _why(rel.reason, claimant, key)
                    for ids in rel.block_ids:
                        invalid.update(ids.tolist())
        return rest

    @property
    def pending(self) -> int:
        """Pushes this decode still waits for."""
        with self._lock:
            return len(self._expected)

    def close(self) -> None:
        """Stop the sending thread (offers not sent yet are dropped; their holds expire)."""
        self._outbox.put(None)
        self._thread.join(self.timeout_s + 1.0)

    def _run(self) -> None:
        while True:
            batch = [self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            targets = [t for t in batch if t is not None]
            if targets:
                self._send(targets)
            if len(targets) < len(batch):
                return

    def _send(self, targets: list[Target]) -> None:
        try:
            replies = call_many(targets, timeout=self.timeout_s, secret=self.secret)
        except Exception as exc:  # the thread must outlive any one batch
            replies = [KVConnectError(f"offer failed: {exc}")] * len(targets)
        for target, reply in zip(targets, replies):
            handle = target.message.params.request_id
            if isinstance(reply, wire.Ack) and target.message.key in reply.live:
                continue
            kind = reply.kind if isinstance(reply, TransferError) else ""
            why = LoadFailure(Stage.OFFER, f"the prefill at {target.host}:{target.port} did not take it: {reply}", kind)
            log.warning("kvconnect load failed: request=%s peer=%s:%s stage=%s reason=%s", handle, target.host,
                        target.port, why.stage, why.reason)
            with self._lock:
                self._why[handle] = why
            self.producer.abort(handle)


def _why(reason: ReleaseReason, claimant: str, key: str) -> LoadFailure:
    if reason is ReleaseReason.EXPIRED:
        return LoadFailure(Stage.TRANSFER, f"no WRITE from the prefill of push {key!r} finished within the deadline")
    if claimant:
        return LoadFailure(Stage.TRANSFER, f"the prefill gave up the WRITE: {claimant}")
    return LoadFailure(Stage.ABORT, "aborted by the engine")
