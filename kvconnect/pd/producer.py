"""Producer (prefill) side of the P/D pull protocol: hold blocks under leases and answer consumers.

The producer's side channel serves its metadata (the handshake) and the consumers' control messages:
a claim pins live leases for the read that follows (a claim for an expired or released request is
refused, so no read is ever served from blocks the engine has reused), heartbeats extend leases, done
and abort release them. Released blocks are reported once through `poll()`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import msgspec

from kvconnect import metrics, wire
from kvconnect.descriptors import check_ids
from kvconnect.errors import BlockRangeError
from kvconnect.pd.leases import Lease, LeaseEnd, LeaseTable, ReleaseReason
from kvconnect.regions import RegionSet
from kvconnect.sidechannel import Refusal, SideChannelServer

log = logging.getLogger(__name__)


class Producer:
    """Holds finished prefills' blocks for consumers to pull."""

    def __init__(self, *, metadata: wire.EngineMetadata, regions: RegionSet, host: str = "127.0.0.1",
                 port: int = 0, advertise_host: str | None = None, secret: bytes | str | None = None,
                 allow_wildcard: bool = False, lease_s: float = 30.0, quiesce_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_offer: Callable[[wire.Offer], None] | None = None):
        """`on_offer`: push mode's prefill side, told of every decode offer (None: offers are refused)."""
        self.metadata = metadata
        self.regions = regions
        self.group_regions = [list(g) for g in metadata.group_regions]
        self.leases = LeaseTable(lease_s=lease_s, clock=clock, on_change=self._lease_changed, quiesce_s=quiesce_s)
        self.on_offer = on_offer
        self._clock = clock
        self.abort_reasons: dict[str, str] = {}  # why a claimant gave up, until the release is polled
        self.server = SideChannelServer(self._handle, host=host, port=port, secret=secret,
                                        allow_wildcard=allow_wildcard)
        self.host = advertise_host or host
        self.port = self.server.port

    def hold(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int,
             lease_s: float | None = None, hard: bool = False, readers: int = 1) -> wire.TransferParams:
        """Keep a request's blocks (one id list per KV group) under a lease; returns its transfer params.

        Pull: a finished prefill's blocks, for consumers to read. Push: blocks a decode allocated, for
        the prefill to write (`lease_s` is then the decode's deadline, `hard`: no claim extends it,
        `readers`: how many prefill ranks write it).
        """
        return self.params_of(self.hold_lease(request_id, block_ids, num_tokens, lease_s, hard, readers))

    def hold_lease(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int,
                   lease_s: float | None = None, hard: bool = False, readers: int = 1) -> Lease:
        """`hold` for an engine that hands out its own params: the lease, no params built."""
        if len(block_ids) != len(self.group_regions):
            raise BlockRangeError(f"{len(block_ids)} block-id groups given, producer has "
                                  f"{len(self.group_regions)} KV groups")
        groups = [check_ids(self.regions, ids, regions) for ids, regions in zip(block_ids, self.group_regions)]
        return self.leases.hold(request_id, groups, num_tokens, lease_s, hard, readers)

    def params_of(self, lease: Lease) -> wire.TransferParams:
        """The transfer params that name a held lease's blocks on this producer."""
        expiry_unix = time.time() + (lease.expires_at - self._clock())
        return wire.TransferParams(
            engine_id=self.metadata.engine_id, host=self.host, port=self.port, request_id=lease.request_id,
            block_ids=[g.tolist() for g in lease.block_ids], num_tokens=lease.num_tokens, lease_expiry=expiry_unix,
            incarnation=self.metadata.incarnation)

    def abort(self, request_id: str) -> bool:
        """Release a request's blocks now (the engine gave up on it); False if it held none."""
        return self.leases.release(request_id, ReleaseReason.ABORTED)

    def poll(self) -> list[LeaseEnd]:
        """Leases that ended since the last call (done, aborted or expired), each reported once."""
        return self.leases.drain_released()

    def abort_reason(self, request_id: str) -> str:
        """Why the claimant of an ended lease gave up ("" if it did not say), forgotten once asked."""
        return self.abort_reasons.pop(request_id, "")

    def close(self) -> None:
        """Stop answering consumers. Held leases stay in the table for the engine to drain."""
        self.server.close()

    @property
    def held_blocks(self) -> int:
        """Blocks live leases hold, all groups counted."""
        return self.leases.held_blocks

    def _lease_changed(self, delta: int, release: LeaseEnd | None) -> None:
        metrics.leases_held.inc(delta)
        if release is None:
            return
        metrics.leases_released.labels(release.reason.value).inc()
        if release.reason is ReleaseReason.EXPIRED:
            log.warning("kvconnect lease expired: request=%s peer=- stage=lease reason=no claim, done, abort or "
                        "heartbeat within %g s", release.request_id, release.lease_s)

    def _handle(self, msg: wire.RequestBody) -> wire.ReplyBody:
        """Answer one side-channel request; runs on the side-channel thread."""
        mine = self.metadata.incarnation
        match msg:
            case wire.HandshakeRequest(rank=rank) if rank == self.metadata.rank:
                return wire.metadata_reply(self.metadata)
            case wire.HandshakeRequest(rank=rank):
                raise Refusal("unknown_rank", f"no metadata for rank {rank}", "unknown_rank", f"no rank {rank} here")
            case wire.Claim(incarnation=claimed) if claimed != mine:
                why = f"producer restarted (incarnation {mine}, claim for {claimed})"
                return wire.ClaimReply(granted_s={}, refused={rid: why for rid in msg.request_ids}, incarnation=mine)
            case wire.Claim():
                granted, refused = self.leases.claim(msg.request_ids, msg.need_s, msg.readers,
                                                     (msg.engine_id, msg.rank))
                return wire.ClaimReply(granted_s=granted, refused=refused, incarnation=mine)
            case wire.Heartbeat():
                live = tuple(self.leases.heartbeat(msg.request_ids))
                log.debug("kvconnect producer: heartbeat for %s, live %s", msg.request_ids, live)
                return wire.Ack(live=live)
            case wire.Done():
                return wire.Ack(live=self._release(msg, ReleaseReason.DONE))
            case wire.Abort():
                ended = self._release(msg, ReleaseReason.ABORTED)
                log.info("kvconnect producer: consumer %s aborted %s: %s", msg.engine_id, ended, msg.reason)
                self.abort_reasons.update((rid, msg.reason) for rid in ended)
                return wire.Ack(live=ended)
            case wire.Offer() if self.on_offer is not None:
                self.on_offer(msg)
                return wire.Ack(live=(msg.key,))
        raise Refusal("unsupported", f"{type(msg).__name__} is not served here", "unsupported")

    def _release(self, msg: wire.Done | wire.Abort, reason: ReleaseReason) -> tuple[str, ...]:
        reader = (msg.engine_id, msg.rank)
        return tuple(rid for rid in msg.request_ids if self.leases.release(rid, reason, reader, msg.readers))


def combine_ranks(per_rank: Sequence[wire.TransferParams]) -> wire.TransferParams:
    """One set of params for a request held by every TP rank of a producer, from each rank's own (rank order)."""
    if not per_rank:
        raise wire.WireError("no per-rank transfer params")
    first = per_rank[0]
    for r, p in enumerate(per_rank):
        if (p.engine_id, p.request_id, p.block_ids, p.num_tokens) != (first.engine_id, first.request_id,
                                                                       first.block_ids, first.num_tokens):
            raise wire.WireError(f"rank {r}'s params name another engine, request or blocks than rank 0's")
    ranks = tuple(wire.RankAddr(host=p.host, port=p.port, incarnation=p.incarnation) for p in per_rank)
    return msgspec.structs.replace(first, lease_expiry=min(p.lease_expiry for p in per_rank), ranks=ranks if len(ranks) > 1 else ())
