"""A load as the per-producer workers see it: one part per producer rank it reads, the messages a
worker's inbox takes, and what a worker needs of the consumer that owns it.

The consumer splits each load into parts (`kvconnect.shards.rank_plan`), hands each part to the
worker of its producer rank, and hears back through `Owner.report_loaded`/`report_failed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from kvconnect import wire
from kvconnect.descriptors import CheckedIds, Selection
from kvconnect.pd.failure import LoadFailure
from kvconnect.pd.fence import Fence
from kvconnect.pd.outbox import NoticeSettings
from kvconnect.regions import RegionSet
from kvconnect.transport.base import Transport


@dataclass
class LoadPart:
    """One queued or running part of a load: what to read from one producer rank, into which blocks, by when."""

    params: wire.TransferParams
    handle: str
    local: tuple[CheckedIds, ...]  # per KV group, checked once when the load was queued
    deadline: float
    remote: tuple[Selection, ...] = ()  # per KV group, once the peer's regions are known
    transfers: list = field(default_factory=list)
    read_until: float = math.inf
    posted_at: float = 0.0
    failure: LoadFailure | None = None
    notify: bool = True
    # Which producer rank this part reads, and how many consumer ranks read that rank.
    peer_rank: int = 0
    readers: int = 1
    op: str = "READ"  # WRITE in push mode: the local blocks are written into the peer's
    # Layer-wise push: the regions whose bytes are final and may be posted (None: all of them); the
    # part finishes only once every region was posted and has landed.
    ready: set[int] | None = None
    posted: set[tuple[int, int]] = field(default_factory=set)  # (group, region) already posted
    # Push from a GPU: nothing is posted before the engine's stream passed `fence` (the whole part), and
    # regions made ready with a fence wait in `fenced`, in order, until theirs is passed.
    fence: Fence | None = None
    fenced: list[tuple[frozenset[int] | None, Fence]] = field(default_factory=list)

    @property
    def open(self) -> bool:
        """Regions may still become ready, or the engine's stream has not passed a fence: it cannot finish yet."""
        return self.ready is not None or self.fence is not None or bool(self.fenced)

    @property
    def request_id(self) -> str:
        """The producer's name for the request (its lease)."""
        return self.params.request_id

    @property
    def incarnation(self) -> str:
        """The incarnation the producer rank held the request under."""
        return self.params.rank(self.peer_rank).incarnation


@dataclass(frozen=True)
class AbortLoad:
    """Inbox: the engine gave up on the load with this handle."""

    handle: str


@dataclass(frozen=True)
class ReleaseLease:
    """Inbox: tell the producer rank to free a request's blocks (read by `readers` consumer ranks)."""

    request_id: str
    readers: int


@dataclass(frozen=True)
class RegionsReady:
    """Inbox, layer-wise push: these regions of a load are final (None: every region)."""

    handle: str
    regions: frozenset[int] | None
    fence: Fence | None = None


class Owner(Protocol):
    """What a peer worker needs of its consumer: settings, the transport, and where results go."""

    engine_id: str
    rank: int
    world_size: int
    secret: bytes | str | None
    expect: wire.Compat
    transport: Transport
    regions: RegionSet
    group_regions: Sequence[Sequence[int]]
    group_bytes: Sequence[int]
    notices: NoticeSettings
    handshake_timeout_s: float
    peer_idle_s: float
    close_timeout_s: float
    clock: Callable[[], float]

    def report_loaded(self, part: LoadPart) -> None:
        """A part finished: every byte of it landed."""

    def report_failed(self, part: LoadPart) -> None:
        """A part failed and nothing more can land from it."""

    def retire(self, worker: object) -> bool:
        """An idle worker asks to exit; False when work reached it meanwhile."""
