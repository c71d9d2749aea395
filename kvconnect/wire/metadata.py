"""What a worker tells its peers about itself: identity, regions, KV-cache groups and the
compatibility fingerprint compared at the handshake."""

from __future__ import annotations

import os
import uuid
from typing import Annotated

from msgspec import Meta, Struct

from kvconnect.wire.limits import (
    I64_MAX, MAX_KV_GROUPS, MAX_NAMES_PER_REGION, MAX_REGIONS, MAX_SEGMENTS, MAX_TP, MAX_TRANSPORT_METADATA_BYTES,
    PROTOCOL_VERSION, STRUCT_CONFIG, Address, BlockSize, Digest, EngineId, Incarnation, MemoryKindName, Name,
    NonNegative, Positive, Rank, RegionIndex, Token, Version,
)


class SegmentMeta(Struct, array_like=True, **STRUCT_CONFIG):
    """One segment of a page's split across TP ranks (mirrors `kvconnect.shards.Segment`)."""

    offset: NonNegative
    repeat: Annotated[int, Meta(ge=1, le=1 << 16)]
    stride: NonNegative
    unit: Positive
    total: Annotated[int, Meta(ge=1, le=1 << 20)]


class GroupSplitMeta(Struct, array_like=True, **STRUCT_CONFIG):
    """How the blocks one KV-cache group reads in a shared region split across TP ranks (None: not described)."""

    group: Annotated[int, Meta(ge=0, lt=MAX_KV_GROUPS)]
    shards: Annotated[tuple[SegmentMeta, ...], Meta(min_length=1, max_length=MAX_SEGMENTS)] | None


class RegionMeta(Struct, **STRUCT_CONFIG):
    """One registered memory region as it crosses the wire (mirrors `kvconnect.regions.Region`)."""

    names: Annotated[tuple[Name, ...], Meta(min_length=1, max_length=MAX_NAMES_PER_REGION)]
    base_addr: Address
    num_blocks: Positive
    block_bytes: Positive
    block_stride: NonNegative
    device_id: Annotated[int, Meta(ge=0, le=65535)]
    memory_kind: MemoryKindName
    # How a page splits across TP ranks; None when the engine described no split (TP sizes must match).
    shards: Annotated[tuple[SegmentMeta, ...], Meta(min_length=1, max_length=MAX_SEGMENTS)] | None = None
    # Per group, where the groups sharing this region read its blocks with different splits.
    group_shards: Annotated[tuple[GroupSplitMeta, ...], Meta(max_length=MAX_KV_GROUPS)] = ()

    def __post_init__(self) -> None:
        # Cross-field checks; during decoding msgspec turns this ValueError into a ValidationError.
        if self.group_shards and (self.shards is not None or len({g.group for g in self.group_shards})
                                  != len(self.group_shards)):
            raise ValueError("group_shards name a group twice, or come beside a region-wide split")
        if self.num_blocks > 1 and self.block_stride < self.block_bytes:
            raise ValueError(f"block_stride {self.block_stride} < block_bytes {self.block_bytes}")
        span = (self.num_blocks - 1) * self.block_stride + self.block_bytes
        if self.base_addr + span - 1 > I64_MAX:
            raise ValueError("region extends past the 63-bit address range")


class GroupCompat(Struct, **STRUCT_CONFIG):
    """What two engines must agree on about one KV-cache group.

    `label` is the engine's name for the group's kind, compared, never interpreted; `page_bytes` are
    the bytes of one block of each of the group's layers, as registered; `layers` hashes their names.
    """

    label: Token
    block_size: BlockSize
    page_bytes: Annotated[tuple[Positive, ...], Meta(min_length=1, max_length=MAX_REGIONS)]
    layers: Digest


class Compat(Struct, **STRUCT_CONFIG):
    """The compatibility fingerprint: fields that must be equal for two engines to exchange KV blocks."""

    protocol_version: Version = PROTOCOL_VERSION
    transport: Token
    layout: Token
    dtype: Token
    block_size: BlockSize
    groups: Annotated[tuple[GroupCompat, ...], Meta(min_length=1, max_length=MAX_KV_GROUPS)]


class EngineMetadata(Struct, **STRUCT_CONFIG):
    """What a worker tells its peers about itself: identity, transport metadata, regions and groups."""

    protocol_version: Version = PROTOCOL_VERSION
    engine_id: EngineId
    # Fresh per process: a peer that restarts under the same engine id must be re-added by the transport.
    incarnation: Incarnation
    rank: Rank
    # The engine's tensor-parallel size: each rank is one worker with its own regions and side channel.
    world_size: Annotated[int, Meta(ge=1, le=MAX_TP)]
    transport: Token
    transport_metadata: Annotated[bytes, Meta(max_length=MAX_TRANSPORT_METADATA_BYTES)] = b""
    regions: Annotated[tuple[RegionMeta, ...], Meta(min_length=1, max_length=MAX_REGIONS)]
    # Region indices of each KV-cache group; a region shared by groups appears in each of them.
    group_regions: Annotated[tuple[Annotated[tuple[RegionIndex, ...], Meta(min_length=1)], ...],
                             Meta(min_length=1, max_length=MAX_KV_GROUPS)]
    block_size: BlockSize
    layout: Token
    dtype: Token
    compat: Compat

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if any(k >= len(self.regions) for g in self.group_regions for k in g):
            raise ValueError(f"a group names a region index past the {len(self.regions)} regions")
        if len(self.group_regions) != len(self.compat.groups):
            raise ValueError("group_regions and compat.groups differ in length")


_incarnation: tuple[int, str] | None = None


def process_incarnation() -> str:
    """This process's incarnation id: random, fixed for the process's life, fresh in a forked child."""
    global _incarnation
    pid = os.getpid()
    if _incarnation is None or _incarnation[0] != pid:
        _incarnation = (pid, uuid.uuid4().hex)
    return _incarnation[1]
