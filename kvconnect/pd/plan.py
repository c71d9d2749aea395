"""What a consumer checks before it reads: a peer's metadata against hard limits, and each load's ids.

Pure functions, no I/O. A peer's metadata are checked before anything is allocated for it: its
identity and groups must equal what we expect, and its regions must pair with ours
(`kvconnect.descriptors.Pairing`: as many regions, equal block bytes, or for another TP size each
region's split mapping onto ours, the byte ranges that peer rank supplies to each local block
computed here, once). The transport takes that pairing as it is. What a peer claims about its block
counts costs nothing until a load reads those blocks. Block ids are checked by
`kvconnect.descriptors` only: local ids when a load is queued, remote ids (the suffix of the params'
ids: a shorter local list pulls the remote suffix, the consumer already holds the prefix) when the
load's selections are made.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from kvconnect import wire
from kvconnect.descriptors import CheckedIds, Pairing, Selection, check_ids, select
from kvconnect.errors import BlockRangeError, HandshakeError, LayoutError
from kvconnect.regions import Region, RegionSet
from kvconnect.shards import PageShards, check_page, coalesce, page_slices


class PeerAddr(NamedTuple):
    """Where one rank of a producer answers, and the engine id it must answer with."""

    engine_id: str
    host: str
    port: int
    rank: int = 0

    @classmethod
    def of(cls, params: wire.TransferParams, rank: int = 0) -> PeerAddr:
        """Rank `rank` of the producer a set of transfer params names."""
        where = params.rank(rank)
        return cls(params.engine_id, where.host, where.port, rank)

    def __str__(self) -> str:
        return f"{self.engine_id}@{self.host}:{self.port}" + (f"#{self.rank}" if self.rank else "")


def check_peer(meta: wire.EngineMetadata, addr: PeerAddr, ours: RegionSet, group_regions: Sequence[Sequence[int]],
               *, tp: int = 1, rank: int = 0, peer_tp: int = 1, write: bool = False) -> Pairing:
    """How the peer's regions pair with ours (whole blocks, or when its TP size differs the byte ranges it
    supplies to each local block; `write`: that each of its blocks takes from ours), once its metadata
    passed every check that must come before allocating for it."""
    if meta.engine_id != addr.engine_id:
        raise HandshakeError(f"peer at {addr.host}:{addr.port} is engine {meta.engine_id!r}, "
                             f"the params name {addr.engine_id!r}")
    if (meta.rank, meta.world_size) != (addr.rank, peer_tp):
        raise HandshakeError(f"peer at {addr.host}:{addr.port} is rank {meta.rank} of TP {meta.world_size}, the "
                             f"params name rank {addr.rank} of TP {peer_tp}")
    if len(meta.regions) != len(ours):
        raise HandshakeError(f"peer has {len(meta.regions)} regions, this consumer {len(ours)}")
    theirs = [list(g) for g in meta.group_regions]
    if theirs != [list(g) for g in group_regions]:
        raise HandshakeError(f"peer groups its regions as {_short(theirs)}, this consumer as {_short(group_regions)}")
    regions = RegionSet.from_wire(meta.regions)
    try:
        slices = None if peer_tp == tp else _slices(ours, regions, group_regions, tp, rank, peer_tp, addr.rank, write)
        return Pairing(ours, regions, slices)
    except LayoutError as exc:
        raise HandshakeError(str(exc)) from None


def _slices(ours: RegionSet, regions: RegionSet, group_regions: Sequence[Sequence[int]], tp: int, rank: int,
            peer_tp: int, peer_rank: int, write: bool = False) -> dict:
    """Per region (per group and region where its groups split it differently), the byte ranges peer rank
    `peer_rank` of `peer_tp` supplies to our rank's blocks (`write`: that our rank supplies to its blocks;
    they differ where one side replicates parts)."""
    slices: dict = {}
    for k, (r, mine) in enumerate(zip(regions.regions, ours.regions)):
        if not (mine.group_shards or r.group_shards):
            slices[k] = _region_slices(k, mine, r, mine.shards, r.shards, tp, rank, peer_tp, peer_rank, write)
            continue
        for g, sel in enumerate(group_regions):
            if k in sel:
                slices[(g, k)] = _region_slices(k, mine, r, mine.split(g), r.split(g), tp, rank, peer_tp, peer_rank,
                                                write, f" for group {g}")
    return slices


def _region_slices(k: int, mine: Region, r: Region, ours: PageShards | None, theirs: PageShards | None, tp: int,
                   rank: int, peer_tp: int, peer_rank: int, write: bool, what: str = ""):
    if ours is None or theirs is None:
        whose = "ours" if ours is None else "the peer's"
        raise HandshakeError(f"cannot map prefill TP {peer_tp} onto decode TP {tp}: region {k} ({mine.label}) "
                             f"has no tensor-parallel split described{what} ({whose})")
    check_page(theirs, peer_tp, r.block_bytes, f"peer region {k} ({mine.label}){what}")
    if write:
        remote, local, length = page_slices(theirs, peer_tp, peer_rank, ours, tp, rank)
        return coalesce(local, remote, length)
    return page_slices(ours, tp, rank, theirs, peer_tp, peer_rank)


def _short(groups: Sequence[Sequence[int]]) -> str:
    text = repr([list(g) for g in groups])
    return text if len(text) <= 120 else text[:117] + "..."


def local_ids(regions: RegionSet, group_regions: Sequence[Sequence[int]], params: wire.TransferParams,
              block_ids: Sequence[Sequence[int]]) -> tuple[CheckedIds, ...]:
    """The local block ids of a load, one array per group, checked against our regions and the params."""
    if len(block_ids) != len(group_regions):
        raise BlockRangeError(f"{len(block_ids)} block-id groups given, this connector has {len(group_regions)} "
                              "KV groups")
    if len(params.block_ids) != len(group_regions):
        raise BlockRangeError(f"transfer params carry {len(params.block_ids)} KV groups, this connector has "
                              f"{len(group_regions)}")
    out = []
    for g, (ids, sel, remote) in enumerate(zip(block_ids, group_regions, params.block_ids)):
        local = check_ids(regions, ids, sel)
        if local.size > len(remote):
            raise BlockRangeError(f"group {g}: {local.size} local blocks but the producer holds only {len(remote)}")
        out.append(local)
    return tuple(out)


def selections(op: str, params: wire.TransferParams, ours: RegionSet, local: Sequence[CheckedIds], peer: RegionSet,
               group_regions: Sequence[Sequence[int]]) -> tuple[Selection, ...]:
    """Per group, what a load moves: its local ids with the suffix of the params' remote ids, checked once."""
    out = []
    for g, (lids, rids, sel) in enumerate(zip(local, params.block_ids, group_regions)):
        try:
            out.append(select(op, ours, lids, peer, rids[len(rids) - lids.size:], sel, group=g))
        except BlockRangeError as exc:
            raise BlockRangeError(f"group {g}: block ids rejected: {exc}") from None
    return tuple(out)


def __getattr__(name: str) -> object:
    """Names that moved out of this module fail with a message naming their replacement."""
    if name == "remote_ids":
        raise ImportError("kvconnect.pd.plan.remote_ids was replaced by kvconnect.pd.plan.selections")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
