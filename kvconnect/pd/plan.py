"""What a consumer checks before it reads: a peer's metadata against hard limits, and each load's ids.

Pure functions, no I/O. A peer's metadata are checked before anything is allocated for it: its region
count, groups and block bytes must equal ours (a peer can only be read into regions that match), and
what it claims about its block counts costs nothing until a load reads those blocks. A load's remote
ids are checked against the peer's regions and aligned to the local ids (a shorter local list pulls
the remote suffix: the consumer already holds the prefix).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from kvconnect import wire
from kvconnect.errors import BlockRangeError, HandshakeError
from kvconnect.regions import RegionSet


class PeerAddr(NamedTuple):
    """Where a producer's side channel is, and the engine id it must answer with."""

    engine_id: str
    host: str
    port: int

    @classmethod
    def of(cls, params: wire.TransferParams) -> PeerAddr:
        """The producer a set of transfer params names."""
        return cls(params.engine_id, params.host, params.port)

    def __str__(self) -> str:
        return f"{self.engine_id}@{self.host}:{self.port}"


def check_peer(meta: wire.EngineMetadata, addr: PeerAddr, ours: RegionSet,
               group_regions: Sequence[Sequence[int]]) -> RegionSet:
    """The peer's regions, once its metadata passed every check that must come before allocating for it."""
    if meta.engine_id != addr.engine_id:
        raise HandshakeError(f"peer at {addr.host}:{addr.port} is engine {meta.engine_id!r}, "
                             f"the params name {addr.engine_id!r}")
    if len(meta.regions) != len(ours):
        raise HandshakeError(f"peer has {len(meta.regions)} regions, this consumer {len(ours)}")
    theirs = [list(g) for g in meta.group_regions]
    if theirs != [list(g) for g in group_regions]:
        raise HandshakeError(f"peer groups its regions as {_short(theirs)}, this consumer as {_short(group_regions)}")
    for k, (r, mine) in enumerate(zip(meta.regions, ours.regions)):
        if r.block_bytes != mine.block_bytes:
            raise HandshakeError(f"region {k} ({mine.label}): peer blocks are {r.block_bytes} bytes, "
                                 f"ours {mine.block_bytes}")
    return RegionSet.from_wire(meta.regions)


def _short(groups: Sequence[Sequence[int]]) -> str:
    text = repr([list(g) for g in groups])
    return text if len(text) <= 120 else text[:117] + "..."


def local_ids(regions: RegionSet, group_regions: Sequence[Sequence[int]], params: wire.TransferParams,
              block_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
    """The local block ids of a load, one array per group, checked against our regions and the params."""
    if len(block_ids) != len(group_regions):
        raise BlockRangeError(f"{len(block_ids)} block-id groups given, this connector has {len(group_regions)} "
                              "KV groups")
    if len(params.block_ids) != len(group_regions):
        raise BlockRangeError(f"transfer params carry {len(params.block_ids)} KV groups, this connector has "
                              f"{len(group_regions)}")
    out = []
    for g, (ids, sel, remote) in enumerate(zip(block_ids, group_regions, params.block_ids)):
        local = regions.validate(ids, sel)
        if local.size > len(remote):
            raise BlockRangeError(f"group {g}: {local.size} local blocks but the producer holds only {len(remote)}")
        out.append(local)
    return tuple(out)


def remote_ids(params: wire.TransferParams, local: Sequence[np.ndarray], peer: RegionSet,
               group_regions: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
    """The remote ids each local id reads, per group: the suffix of the params' ids, checked against the peer."""
    out = []
    for g, (lids, rids, sel) in enumerate(zip(local, params.block_ids, group_regions)):
        suffix = np.asarray(rids[len(rids) - lids.size:], dtype=np.int64)
        try:
            out.append(peer.validate(suffix, sel))
        except BlockRangeError as exc:
            raise BlockRangeError(f"group {g}: remote block ids rejected: {exc}") from None
    return tuple(out)
