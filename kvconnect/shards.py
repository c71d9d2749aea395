"""How a page splits across tensor-parallel ranks, and which bytes of which peer rank feed a local page.

An engine shards a layer's KV across its TP ranks along one dimension (attention: the KV heads; a
Mamba state: its heads or channels). kvconnect never asks which: the engine adapter describes each
page as `Segment`s, each a set of rows of parts (`repeat` rows, row i at `offset + i * stride` bytes
into the page, every row holding this rank's parts of a dimension of `total` parts, `unit` bytes per
part). An attention page `[heads, tokens, 2 * head_size]` is one segment of one row; `[tokens,
heads, 2 * head_size]` is one segment of `tokens` rows; an MLA latent, the same on every rank, is one
segment of one part in all (`total=1`). A rank of a TP size larger than `total` holds one part,
replicated (vLLM's rule for fewer KV heads than ranks). Bytes of a page outside every segment are
padding (a state page padded to the attention page's size): they never move between TP sizes.

Between two TP sizes, each local part is read from one peer rank that holds it; `rank_plan` says
which peer ranks a local rank reads and how many local ranks read each peer rank (a peer rank's
lease ends when all of them are done), and `page_slices` gives the byte ranges, coalesced where both
sides are contiguous. Pure functions of the two sides' segments, computed once per peer pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from kvconnect.errors import HandshakeError, LayoutError
from kvconnect.runs import runs

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
    """The page's content as one rank of TP 1 would hold it (what two TP sizes must agree on): every
    segment's parts; the whole page where no split is described."""
    if not segments:
        return page_bytes
    return sum(s.repeat * s.total * s.unit for s in segments)


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


def write_plan(pages: Sequence[PageShards | None], tp: int, rank: int, peer_tp: int) -> RankPlan:
    """Push: which peer ranks local `rank` of `tp` writes a request into. Each peer rank takes each of its
    parts from the one local rank `rank_plan` would have it read from, so every peer page is covered
    once (replicated peer parts too); `readers[p]`: how many local ranks write peer rank p."""
    if peer_tp == tp:
        return RankPlan(reads=(rank,), readers=(1,) * tp, releases=())
    writers = [rank_plan(pages, peer_tp, p, tp).reads for p in range(peer_tp)]
    return RankPlan(reads=tuple(p for p in range(peer_tp) if rank in writers[p]),
                    readers=tuple(len(w) for w in writers), releases=())


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
    first, _ = runs(local, remote, step=length)
    return local[first], remote[first], np.add.reduceat(length, first) if first.size else length[:0]


def attention(tokens: int, heads: int, head_bytes: int, total_heads: int, heads_outer: bool) -> PageShards:
    """The split of an attention page: `[heads, tokens, head_bytes]` (heads_outer) or `[tokens, heads,
    head_bytes]`, K and V packed in `head_bytes`; `heads` is this rank's count of `total_heads`."""
    if heads_outer:
        return (Segment(offset=0, repeat=1, stride=0, unit=tokens * head_bytes, total=total_heads),)
    return (Segment(offset=0, repeat=tokens, stride=heads * head_bytes, unit=head_bytes, total=total_heads),)


def mamba2_state(heads: int, head_dim: int, d_state: int, groups: int, taps: int, conv_bytes: int, ssm_bytes: int,
                 tp: int, channels_first: bool = False) -> PageShards:
    """The split of a Mamba2 state page as one rank of `tp` holds it: a conv state of `taps` values over
    channels `[x | B | C]` (`taps` rows of every channel, or with `channels_first` one run of taps per
    channel), then the SSM state `[heads, head_dim, d_state]`; `heads` is this rank's count, x splits by
    head, B and C by group (`groups`, model-wide; a rank of a TP size above it holds one, replicated)."""
    x, bc = heads * head_dim, max(groups // tp, 1) * d_state
    channels = x + 2 * bc
    if channels_first:
        conv = (Segment(0, 1, 0, head_dim * taps * conv_bytes, heads * tp),
                Segment(x * taps * conv_bytes, 1, 0, d_state * taps * conv_bytes, groups),
                Segment((x + bc) * taps * conv_bytes, 1, 0, d_state * taps * conv_bytes, groups))
    else:
        row = channels * conv_bytes
        conv = (Segment(0, taps, row, head_dim * conv_bytes, heads * tp),
                Segment(x * conv_bytes, taps, row, d_state * conv_bytes, groups),
                Segment((x + bc) * conv_bytes, taps, row, d_state * conv_bytes, groups))
    return (*conv, Segment(channels * taps * conv_bytes, 1, 0, head_dim * d_state * ssm_bytes, heads * tp))


def replicated(page_bytes: int) -> PageShards:
    """A page every rank holds whole (an MLA latent): one part of `page_bytes`."""
    return (Segment(offset=0, repeat=1, stride=0, unit=page_bytes, total=1),)


# Per region index (or (group, region index) where a region's groups split its blocks differently): (local
# byte offsets, peer byte offsets, lengths) inside one block, as `page_slices` gives them.
PageSlices = Mapping[int | tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]

_MOVED = {"assign_shards": "kvconnect.region_splits", "slice_descriptors": "kvconnect.descriptors"}


def __getattr__(name: str) -> object:
    """Names that moved out of this module fail with a message naming their new home."""
    if name in _MOVED:
        raise ImportError(f"kvconnect.shards.{name} moved to {_MOVED[name]}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
