"""How a page splits across tensor-parallel ranks, and which bytes of which peer rank feed a local page.

An engine shards a layer's KV across its TP ranks along one dimension (attention: the KV heads; a
Mamba state: its heads or channels). kvconnect never asks which: the engine adapter describes each
page as `Segment`s, each a set of rows of parts (`repeat` rows, row i at `offset + i * stride` bytes
into the page, every row holding this rank's parts of a dimension of `total` parts, `unit` bytes per
part). An attention page `[heads, tokens, 2 * head_size]` is one segment of one row; `[tokens,
heads, 2 * head_size]` is one segment of `tokens` rows; an MLA latent, the same on every rank, is one
segment of one part in all (`total=1`). A rank of a TP size larger than `total` holds one part,
replicated (vLLM's rule for fewer KV heads than ranks).

Between two TP sizes, each local part is read from one peer rank that holds it; `rank_plan` says
which peer ranks a local rank reads and how many local ranks read each peer rank (a peer rank's
lease ends when all of them are done), and `page_slices` gives the byte ranges, coalesced where both
sides are contiguous. Pure functions of the two sides' segments, computed once per peer pair.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from kvconnect.errors import BlockRangeError, HandshakeError, LayoutError

if TYPE_CHECKING:
    from kvconnect.regions import Region, RegionSet

# Rows of one page, over all its segments: a page is a few thousand bytes to a few MiB.
MAX_ROWS_PER_PAGE = 1 << 16


@dataclass(frozen=True)
class Segment:
    """Rows of parts inside a page: row i at `offset + i * stride` bytes holds this rank's parts of
    `total` (`unit` bytes each), side by side."""

    offset: int
    repeat: int
    stride: int
    unit: int
    total: int

    def parts(self, tp: int) -> int:
        """How many parts one rank of a TP size holds."""
        return max(self.total // tp, 1)


PageShards = tuple[Segment, ...]


def owned(total: int, tp: int, rank: int) -> tuple[int, int]:
    """(first part, part count) that `rank` of `tp` ranks holds of `total` parts; LayoutError if they do not split."""
    if tp <= total:
        if total % tp:
            raise LayoutError(f"{total} parts do not split over {tp} ranks")
        n = total // tp
        return rank * n, n
    if tp % total:
        raise LayoutError(f"{total} parts cannot be replicated evenly over {tp} ranks")
    return rank // (tp // total), 1


def check_page(segments: Sequence[Segment], tp: int, page_bytes: int, what: str) -> None:
    """Refuse segments that do not fit a page of `page_bytes` at this TP size, or that overlap."""
    rows = sum(s.repeat for s in segments)
    if not segments or rows > MAX_ROWS_PER_PAGE:
        raise LayoutError(f"{what}: {len(segments)} segments of {rows} rows (1 to {MAX_ROWS_PER_PAGE} rows)")
    starts, ends = [], []
    for k, s in enumerate(segments):
        if min(s.offset, s.stride) < 0 or min(s.repeat, s.unit, s.total) < 1:
            raise LayoutError(f"{what}: segment {k} has a negative or zero field: {s}")
        owned(s.total, tp, 0)
        width = s.parts(tp) * s.unit
        if s.repeat > 1 and s.stride < width:
            raise LayoutError(f"{what}: segment {k}'s rows ({width} bytes) overlap (stride {s.stride})")
        if s.offset + (s.repeat - 1) * s.stride + width > page_bytes:
            raise LayoutError(f"{what}: segment {k} runs past the page's {page_bytes} bytes")
        row = s.offset + np.arange(s.repeat, dtype=np.int64) * s.stride
        starts.append(row)
        ends.append(row + width)
    start, end = np.concatenate(starts), np.concatenate(ends)
    order = np.argsort(start, kind="stable")
    if np.any(start[order][1:] < end[order][:-1]):
        raise LayoutError(f"{what}: segments overlap")


def global_bytes(segments: Sequence[Segment] | None, page_bytes: int, tp: int) -> int:
    """The page's bytes as one rank of TP 1 would hold them (what two TP sizes must agree on)."""
    if not segments:
        return page_bytes
    local = sum(s.repeat * s.parts(tp) * s.unit for s in segments)
    return page_bytes - local + sum(s.repeat * s.total * s.unit for s in segments)


def _source(part: int, total: int, peer_tp: int, rank: int) -> int:
    """The peer rank a local rank reads global part `part` from (replicas are spread over local ranks)."""
    if peer_tp <= total:
        return part // (total // peer_tp)
    replicas = peer_tp // total
    return part * replicas + rank % replicas


def _sources(segments: Sequence[Segment], tp: int, rank: int, peer_tp: int) -> set[int]:
    out: set[int] = set()
    for s in segments:
        first, n = owned(s.total, tp, rank)
        owned(s.total, peer_tp, 0)
        out.update(_source(h, s.total, peer_tp, rank) for h in range(first, first + n))
    return out


@dataclass(frozen=True)
class RankPlan:
    """What one local rank does with a request held by `peer_tp` peer ranks.

    `reads`: peer ranks it reads from; `readers[p]`: how many local ranks read peer rank p (its lease
    ends once all of them are done); `releases`: peer ranks no local rank reads that this rank tells
    to free the request's blocks.
    """

    reads: tuple[int, ...]
    readers: tuple[int, ...]
    releases: tuple[int, ...]


def rank_plan(pages: Sequence[PageShards | None], tp: int, rank: int, peer_tp: int) -> RankPlan:
    """Which peer ranks local `rank` of `tp` reads a request from; HandshakeError when the sizes cannot map."""
    if peer_tp == tp:
        return RankPlan(reads=(rank,), readers=(1,) * tp, releases=())
    try:
        if any(p is None for p in pages):
            raise LayoutError("a layer's pages have no tensor-parallel split described")
        per_rank = [set().union(*(_sources(p, tp, r, peer_tp) for p in pages)) for r in range(tp)]
    except LayoutError as exc:
        raise HandshakeError(f"cannot map prefill TP {peer_tp} onto decode TP {tp}: {exc}") from None
    readers = tuple(sum(p in s for s in per_rank) for p in range(peer_tp))
    releases = tuple(p for p in range(peer_tp) if readers[p] == 0 and p % tp == rank)
    return RankPlan(reads=tuple(sorted(per_rank[rank])), readers=readers, releases=releases)


def page_slices(mine: PageShards, tp: int, rank: int, theirs: PageShards, peer_tp: int,
                peer_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local offsets, peer offsets, lengths) in bytes of the parts peer rank `peer_rank` supplies to
    a local page, coalesced where contiguous on both sides; HandshakeError when the segments disagree."""
    if len(mine) != len(theirs):
        raise HandshakeError(f"pages split in {len(mine)} segments here, {len(theirs)} on the peer")
    local, remote, length = [], [], []
    for k, (m, t) in enumerate(zip(mine, theirs)):
        if (m.unit, m.total, m.repeat) != (t.unit, t.total, t.repeat):
            raise HandshakeError(f"segment {k} differs: ours {m.total} parts of {m.unit} bytes in {m.repeat} rows, "
                                 f"the peer's {t.total} of {t.unit} in {t.repeat}")
        first, n = owned(m.total, tp, rank)
        parts = np.arange(first, first + n)
        src = np.array([_source(int(h), m.total, peer_tp, rank) for h in parts])
        mine_parts = parts[src == peer_rank]
        if not mine_parts.size:
            continue
        peer_first, _ = owned(t.total, peer_tp, peer_rank)
        row = np.arange(m.repeat, dtype=np.int64)
        lo = (m.offset + row[:, None] * m.stride + (mine_parts - first)[None, :] * m.unit).ravel()
        ro = (t.offset + row[:, None] * t.stride + (mine_parts - peer_first)[None, :] * t.unit).ravel()
        local.append(lo)
        remote.append(ro)
        length.append(np.full(lo.size, m.unit, dtype=np.int64))
    if not local:
        return (np.empty(0, np.int64),) * 3
    return coalesce(np.concatenate(local), np.concatenate(remote), np.concatenate(length))


def coalesce(local: np.ndarray, remote: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge byte ranges that follow each other on both sides into one."""
    order = np.argsort(local, kind="stable")
    local, remote, length = local[order], remote[order], length[order]
    starts, sizes = _runs(local, remote, length)
    return local[starts], remote[starts], sizes


def _runs(local: np.ndarray, remote: np.ndarray, length: np.ndarray,
          same: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Where runs of ranges that follow each other on both sides (in the order given) start, and the
    bytes of each run; `same[i]` False keeps ranges i and i+1 apart (another device)."""
    joins = (local[:-1] + length[:-1] == local[1:]) & (remote[:-1] + length[:-1] == remote[1:])
    if same is not None:
        joins &= same
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    last = np.append(starts[1:], local.size) - 1
    return starts, local[last] + length[last] - local[starts]


def attention(tokens: int, heads: int, head_bytes: int, total_heads: int, heads_outer: bool) -> PageShards:
    """The split of an attention page: `[heads, tokens, head_bytes]` (heads_outer) or `[tokens, heads,
    head_bytes]`, K and V packed in `head_bytes`; `heads` is this rank's count of `total_heads`."""
    if heads_outer:
        return (Segment(offset=0, repeat=1, stride=0, unit=tokens * head_bytes, total=total_heads),)
    return (Segment(offset=0, repeat=tokens, stride=heads * head_bytes, unit=head_bytes, total=total_heads),)


def replicated(page_bytes: int) -> PageShards:
    """A page every rank holds whole (an MLA latent): one part of `page_bytes`."""
    return (Segment(offset=0, repeat=1, stride=0, unit=page_bytes, total=1),)


def assign_shards(regions: list[Region], layers: Mapping[str, Region],
                  shards: Mapping[str, PageShards]) -> list[Region]:
    """Each region with its split: its layers' segments, shifted to where each layer's page starts in the block.

    Aliased layers (one memory, several names) must describe one split, or the region has none: it
    then moves only between equal TP sizes.
    """
    unknown = sorted(set(shards) - set(layers))
    if unknown:
        raise LayoutError(f"shards describe layers that were not registered: {unknown[:5]}")
    out = []
    for r in regions:
        by_base: dict[int, set] = {}
        for name in r.names:
            segs = shards.get(name)
            by_base.setdefault(layers[name].base_addr, set()).add(None if segs is None else tuple(segs))
        if any(len(v) != 1 or None in v for v in by_base.values()):
            out.append(r)
            continue
        segments = tuple(Segment(s.offset + base - r.base_addr, s.repeat, s.stride, s.unit, s.total)
                         for base, v in sorted(by_base.items()) for s in next(iter(v)))
        out.append(dataclasses.replace(r, shards=segments))
    return out


# Per region index: (local byte offsets, peer byte offsets, lengths) inside one block (kvconnect.shards).
PageSlices = Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]]


def slice_descriptors(
    local: RegionSet,
    local_ids: np.ndarray,
    remote: RegionSet,
    remote_ids: np.ndarray,
    slices: PageSlices,
    regions: Sequence[int] | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Matched descriptors for a peer that holds other byte ranges of each page (another TP size):
    per selected region and block pair, the ranges `slices[region]` pairs; rows that follow each other
    on both sides merge."""
    sel = np.arange(len(local)) if regions is None else np.asarray(regions, dtype=np.int64).reshape(-1)
    lids = local.validate(local_ids, sel)
    rids = remote.validate(remote_ids, sel)
    if lids.size != rids.size:
        raise BlockRangeError(f"{lids.size} local block ids but {rids.size} remote block ids")
    parts_l, parts_r = [], []
    lu, ru = lids.astype(np.uint64), rids.astype(np.uint64)
    for k in sel.tolist():  # one step per region: the blocks and ranges inside are numpy
        lo, ro, ln = (np.asarray(a, dtype=np.uint64) for a in slices.get(k, (_NONE, _NONE, _NONE)))
        if not ln.size or not lids.size:
            continue
        n = lids.size * ln.size
        rows_l, rows_r = np.empty((n, 3), dtype=np.uint64), np.empty((n, 3), dtype=np.uint64)
        mine, theirs = local[k], remote[k]
        rows_l[:, 0] = (np.uint64(mine.base_addr) + lu[:, None] * np.uint64(mine.block_stride) + lo[None, :]).ravel()
        rows_r[:, 0] = (np.uint64(theirs.base_addr) + ru[:, None] * np.uint64(theirs.block_stride) + ro[None, :]).ravel()
        rows_l[:, 1] = rows_r[:, 1] = np.tile(ln, lids.size)
        rows_l[:, 2], rows_r[:, 2] = mine.device_id, theirs.device_id
        parts_l.append(rows_l)
        parts_r.append(rows_r)
    if not parts_l:
        return np.empty((0, 3), np.uint64), np.empty((0, 3), np.uint64)
    rows_l, rows_r = np.concatenate(parts_l), np.concatenate(parts_r)
    same = (rows_l[:-1, 2] == rows_l[1:, 2]) & (rows_r[:-1, 2] == rows_r[1:, 2])
    starts, sizes = _runs(rows_l[:, 0], rows_r[:, 0], rows_l[:, 1], same)
    if starts.size == rows_l.shape[0]:
        return rows_l, rows_r
    out_l, out_r = rows_l[starts], rows_r[starts]
    out_l[:, 1] = out_r[:, 1] = sizes
    return out_l, out_r


_NONE = np.empty(0, dtype=np.uint64)
