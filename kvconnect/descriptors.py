"""Block ids turned into transfer descriptors: checked once, paired with a peer's, sliced and coalesced.

Descriptor arrays are `(N, 3)` uint64 rows `(addr, nbytes, device_id)`, built with numpy and never
with a Python loop per block. Each check lives in one place and yields a value that says it was made:

- `check_ids`: block ids are integers inside every selected region of one `RegionSet` -> `CheckedIds`
  (a read-only int64 array that remembers the set and regions; checking it again costs nothing).
- `select`: an op, as many local ids as remote ones, no destination block named twice -> `Selection`.
- `Pairing`: a peer's regions pair with ours (as many regions; equal block bytes, or byte slices of a
  peer of another TP size that fit both blocks), checked once per peer.

A transport takes a `Selection` made for its registered regions and its peer's (an identity check),
and turns it into rows with the peer's `Pairing` without looking at an id again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvconnect.errors import BlockRangeError, LayoutError, LocalInvalid
from kvconnect.regions import BlockIds, RegionSet
from kvconnect.runs import runs
from kvconnect.shards import PageSlices

OPS = ("READ", "WRITE")
RegionIndices = Sequence[int] | np.ndarray | None
_EMPTY = np.empty((0, 3), dtype=np.uint64)
_NONE = np.empty(0, dtype=np.int64)


class CheckedIds(np.ndarray):
    """Block ids known to be inside every region `selected` of the set `rs`: a read-only int64 array.

    An array derived from it (a slice, a sum) is a plain array again as far as `check_ids` knows.
    """

    rs: RegionSet | None
    selected: np.ndarray

    def __array_finalize__(self, obj: object) -> None:
        self.rs, self.selected = None, _NONE

    def tail(self, n: int) -> CheckedIds:
        """The last `n` ids, still known to be in range (a part of checked ids needs no new check)."""
        out = self[self.size - n:] if n else self[:0]
        out.rs, out.selected = self.rs, self.selected
        return out

    def covers(self, rs: RegionSet, selected: np.ndarray) -> bool:
        """Whether these ids were checked against `rs` for (at least) the `selected` regions."""
        return self.rs is rs and (selected is self.selected or bool(np.isin(selected, self.selected).all()))


def _as_ids(block_ids: BlockIds) -> np.ndarray:
    """Block ids as a 1-D int64 array, refusing anything that is not an integer."""
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().cpu().numpy()
    arr = np.asarray(block_ids)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1:
        raise BlockRangeError(f"block ids must be a flat sequence, got shape {arr.shape}")
    if arr.dtype.kind == "u":
        if arr.max() > np.iinfo(np.int64).max:
            pos = int(np.argmax(arr > np.iinfo(np.int64).max))
            raise BlockRangeError(f"block ids: id {arr[pos]} at position {pos} is out of range")
        return arr.astype(np.int64)
    if arr.dtype.kind != "i":
        values = list(block_ids) if isinstance(block_ids, (list, tuple)) else arr.tolist()
        pos = next((p for p, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, int)), 0)
        raise BlockRangeError(f"block ids must be integers: {values[pos]!r} at position {pos}")
    return arr.astype(np.int64, copy=False)


def check_ids(rs: RegionSet, block_ids: BlockIds, regions: RegionIndices = None) -> CheckedIds:
    """The ids, checked to be inside every selected region (default: all) of `rs`; BlockRangeError naming the
    first bad id, its position and the region, LayoutError for a region index outside the set."""
    sel = rs.indices(regions)
    if isinstance(block_ids, CheckedIds) and block_ids.covers(rs, sel):
        return block_ids
    ids = _as_ids(block_ids)
    if ids.size and sel.size:
        limits = rs.block_counts[sel]
        smallest = int(np.argmin(limits))
        bad = (ids < 0) | (ids >= limits[smallest])
        if bad.any():
            pos = int(np.argmax(bad))
            region = rs[int(sel[smallest])]
            raise BlockRangeError(f"block id {int(ids[pos])} at position {pos} is out of range for region "
                                  f"{region.label} (num_blocks={region.num_blocks})")
    # A copy unless the array is ours alone: the caller must not be able to change checked ids afterwards.
    out = (ids.copy() if isinstance(block_ids, (np.ndarray, torch.Tensor)) else ids).view(CheckedIds)
    out.flags.writeable = False
    out.rs, out.selected = rs, sel
    return out


@dataclass(frozen=True, eq=False)
class Selection:
    """One transfer's blocks, checked: `local_ids[k]` of `local` pairs with `remote_ids[k]` of `remote` in
    every region of `regions`; READ moves remote to local, WRITE local to remote."""

    op: str
    local: RegionSet
    remote: RegionSet
    regions: np.ndarray
    local_ids: CheckedIds
    remote_ids: CheckedIds
    # The KV-cache group the blocks belong to: a pairing whose regions split per group slices by it.
    group: int = 0

    @property
    def blocks(self) -> int:
        """Blocks moved: ids times regions."""
        return int(self.local_ids.size * self.regions.size)

    def only(self, regions: Sequence[int] | np.ndarray) -> Selection:
        """The same blocks in fewer regions (a subset of these; LayoutError otherwise): nothing to check again."""
        sub = self.local.indices(regions)
        if not np.isin(sub, self.regions).all():
            raise LayoutError(f"regions {sub.tolist()} are not all among the selected {self.regions.tolist()}")
        return dataclasses.replace(self, regions=sub)


def select(op: str, local: RegionSet, local_ids: BlockIds, remote: RegionSet, remote_ids: BlockIds,
           regions: RegionIndices = None, group: int = 0) -> Selection:
    """A checked selection: both id lists inside the selected regions of their side, equally long, and no
    destination block named twice (two sources landing in one block would leave whichever finished last)."""
    if op not in OPS:
        raise LocalInvalid(f"unknown transfer op {op!r} (expected READ or WRITE)")
    sel = local.indices(regions)
    lids = check_ids(local, local_ids, sel)
    rids = check_ids(remote, remote_ids, sel)
    if lids.size != rids.size:
        raise BlockRangeError(f"{lids.size} local block ids but {rids.size} remote block ids")
    dst = lids if op == "READ" else rids
    if dst.size > 1:
        ordered = np.sort(dst)
        twice = ordered[1:][ordered[1:] == ordered[:-1]]
        if twice.size:
            side = "local" if op == "READ" else "remote"
            raise BlockRangeError(f"{op} names {side} block {int(twice[0])} more than once as a destination")
    return Selection(op, local, remote, sel, lids, rids, group)


class Pairing:
    """How our regions pair with one peer's, checked once: region k with region k, whole blocks of equal
    bytes, or (`slices`, a peer of another TP size) the byte ranges of each block that peer holds."""

    def __init__(self, local: RegionSet, remote: RegionSet, slices: PageSlices | None = None):
        if len(local) != len(remote):
            raise LayoutError(f"local has {len(local)} regions, peer has {len(remote)}")
        self.local, self.remote = local, remote
        self.slices: dict[int | tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        if slices is None:
            differ = np.flatnonzero(local.block_sizes != remote.block_sizes)
            if differ.size:
                k = int(differ[0])
                raise LayoutError(f"region {k} ({local[k].label}): local blocks are {local[k].block_bytes} bytes, "
                                  f"peer blocks are {remote[k].block_bytes} bytes")
        else:
            self.slices = {k: _checked_slices(local, remote, k, s) for k, s in slices.items()}
        # A run of blocks is one row only where it is back to back on both sides.
        self._mergeable = local.contiguous & remote.contiguous

    def __repr__(self) -> str:
        how = "whole blocks" if self.slices is None else f"slices of {len(self.slices)} regions"
        return f"<Pairing of {len(self.local)} regions, {how}>"

    def select(self, op: str, local_ids: BlockIds, remote_ids: BlockIds, regions: RegionIndices = None,
               group: int = 0) -> Selection:
        """`select` over this pairing's two region sets."""
        return select(op, self.local, local_ids, self.remote, remote_ids, regions, group)

    def admit(self, selection: Selection) -> None:
        """Refuse a selection made for other region sets than this pairing's (identity, not contents)."""
        if not isinstance(selection, Selection):
            raise LocalInvalid(f"not a Selection: {type(selection).__name__}")
        if selection.local is not self.local or selection.remote is not self.remote:
            raise LocalInvalid("the selection was made for other regions than this transport's and its peer's")

    def rows(self, selection: Selection) -> tuple[np.ndarray, np.ndarray]:
        """Matched local and peer rows of a selection `admit` accepted: row k of one moves to row k of the other."""
        sel, lids, rids = selection.regions, selection.local_ids, selection.remote_ids
        if lids.size == 0 or sel.size == 0:
            return _EMPTY.copy(), _EMPTY.copy()
        if self.slices is not None:
            return _slice_rows(self.local, lids, self.remote, rids, self.slices, sel, selection.group)
        starts, lengths = runs(lids, rids)
        both = self._mergeable[sel]
        return (_build(self.local, sel, lids, starts, lengths, both),
                _build(self.remote, sel, rids, starts, lengths, both))


def _checked_slices(local: RegionSet, remote: RegionSet, key: int | tuple[int, int],
                    ranges: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One region's slices (key: its index, or (group, index) for one group's blocks there) as uint64 arrays,
    refused when malformed or running past either side's block."""
    k = key[1] if isinstance(key, tuple) else key
    if not 0 <= k < len(local):
        raise LayoutError(f"slices name region {k}, outside 0..{len(local) - 1}")
    lo, ro, ln = (np.asarray(a, dtype=np.int64).reshape(-1) for a in ranges)
    if not (lo.shape == ro.shape == ln.shape) or (ln.size and (min(lo.min(), ro.min()) < 0 or ln.min() < 1)):
        raise LayoutError(f"region {k}: malformed slices")
    if ln.size and ((lo + ln).max() > local[k].block_bytes or (ro + ln).max() > remote[k].block_bytes):
        raise LayoutError(f"region {k} ({local[k].label}): a slice runs past a block "
                          f"({local[k].block_bytes} bytes here, {remote[k].block_bytes} on the peer)")
    return lo.astype(np.uint64), ro.astype(np.uint64), ln.astype(np.uint64)


def block_rows(rs: RegionSet, block_ids: BlockIds, regions: RegionIndices = None) -> np.ndarray:
    """`(N, 3)` rows for these blocks in the selected regions of `rs`, region-major; runs of back-to-back
    blocks merge into one row."""
    sel = rs.indices(regions)
    ids = check_ids(rs, block_ids, sel)
    if ids.size == 0 or sel.size == 0:
        return _EMPTY.copy()
    starts, lengths = runs(ids)
    return _build(rs, sel, ids, starts, lengths, rs.contiguous[sel])


def block_table(regions: RegionSet) -> tuple[np.ndarray, np.ndarray]:
    """One row per block of every region, region-major, and each region's first row (a prepared list's index)."""
    counts = regions.block_counts
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    region = np.repeat(np.arange(len(regions)), counts)
    block = (np.arange(int(counts.sum()), dtype=np.int64) - offsets[region]).astype(np.uint64)
    rows = np.empty((block.size, 3), dtype=np.uint64)
    rows[:, 0] = regions.base_addrs[region] + block * regions.block_strides[region]
    rows[:, 1] = regions.block_sizes[region]
    rows[:, 2] = regions.device_ids[region]
    return rows, offsets


def table_indices(offsets: np.ndarray, selected: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of `block_table` for these blocks in the selected regions, region-major, as int32 (NIXL's index type)."""
    return (offsets[selected][:, None] + np.asarray(ids)[None, :]).ravel().astype(np.int32)


def pair_descriptors(local: RegionSet, local_ids: BlockIds, remote: RegionSet, remote_ids: BlockIds,
                     regions: RegionIndices = None) -> tuple[np.ndarray, np.ndarray]:
    """Matched local/remote rows of whole blocks: row k of one moves to row k of the other."""
    pairing = Pairing(local, remote)
    return pairing.rows(_unordered(local, local_ids, remote, remote_ids, regions))


def slice_descriptors(local: RegionSet, local_ids: BlockIds, remote: RegionSet, remote_ids: BlockIds,
                      slices: PageSlices, regions: RegionIndices = None) -> tuple[np.ndarray, np.ndarray]:
    """Matched rows for a peer that holds other byte ranges of each page (another TP size): per selected
    region and block pair, the ranges `slices[region]` pairs; rows that follow each other on both sides merge."""
    pairing = Pairing(local, remote, slices)
    return pairing.rows(_unordered(local, local_ids, remote, remote_ids, regions))


def _unordered(local: RegionSet, local_ids: BlockIds, remote: RegionSet, remote_ids: BlockIds,
               regions: RegionIndices) -> Selection:
    """A selection with no direction (descriptors only): ids checked, counts equal, repeats allowed."""
    sel = local.indices(regions)
    lids, rids = check_ids(local, local_ids, sel), check_ids(remote, remote_ids, sel)
    if lids.size != rids.size:
        raise BlockRangeError(f"{lids.size} local block ids but {rids.size} remote block ids")
    return Selection("READ", local, remote, sel, lids, rids)


def _build(rs: RegionSet, sel: np.ndarray, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
           mergeable: np.ndarray) -> np.ndarray:
    """Rows for the selected regions: one per run where `mergeable`, else one per block; region-major."""
    if mergeable.all():
        return _rows(rs, sel, ids[starts], lengths)
    ones = np.ones_like(ids)
    if not mergeable.any():
        return _rows(rs, sel, ids, ones)
    merged = _rows(rs, sel[mergeable], ids[starts], lengths)
    single = _rows(rs, sel[~mergeable], ids, ones)
    order = np.concatenate((np.repeat(np.flatnonzero(mergeable), starts.size),
                            np.repeat(np.flatnonzero(~mergeable), ids.size)))
    return np.concatenate((merged, single))[np.argsort(order, kind="stable")]


def _rows(rs: RegionSet, sel: np.ndarray, first: np.ndarray, count: np.ndarray) -> np.ndarray:
    out = np.empty((sel.size * first.size, 3), dtype=np.uint64)
    first = np.asarray(first).astype(np.uint64)
    count = np.asarray(count).astype(np.uint64)
    out[:, 0] = (rs.base_addrs[sel, None] + first[None, :] * rs.block_strides[sel, None]).ravel()
    out[:, 1] = (count[None, :] * rs.block_sizes[sel, None]).ravel()
    out[:, 2] = np.repeat(rs.device_ids[sel], first.size)
    return out


def _slice_rows(local: RegionSet, lids: np.ndarray, remote: RegionSet, rids: np.ndarray,
                slices: dict[int | tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]],
                sel: np.ndarray, group: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per selected region and block pair, the paired byte ranges; ranges that follow each other on both sides
    (and stay on one device) merge."""
    parts_l, parts_r = [], []
    lu, ru = np.asarray(lids).astype(np.uint64), np.asarray(rids).astype(np.uint64)
    for k in sel.tolist():  # one step per region: the blocks and ranges inside are numpy
        ranges = slices.get((group, k), slices.get(k))
        if ranges is None:
            # Skipping it would move a request's KV without this region's bytes: refuse instead.
            raise LayoutError(f"slices give no byte ranges for region {k} ({local[k].label})"
                              + (f" in group {group}" if group else ""))
        if not ranges[2].size:
            continue  # the peer rank holds none of this region's bytes
        lo, ro, ln = ranges
        n = lu.size * ln.size
        rows_l, rows_r = np.empty((n, 3), dtype=np.uint64), np.empty((n, 3), dtype=np.uint64)
        mine, theirs = local[k], remote[k]
        rows_l[:, 0] = (np.uint64(mine.base_addr) + lu[:, None] * np.uint64(mine.block_stride) + lo[None, :]).ravel()
        rows_r[:, 0] = (np.uint64(theirs.base_addr) + ru[:, None] * np.uint64(theirs.block_stride) + ro[None, :]).ravel()
        rows_l[:, 1] = rows_r[:, 1] = np.tile(ln, lu.size)
        rows_l[:, 2], rows_r[:, 2] = mine.device_id, theirs.device_id
        parts_l.append(rows_l)
        parts_r.append(rows_r)
    if not parts_l:
        return _EMPTY.copy(), _EMPTY.copy()
    rows_l, rows_r = np.concatenate(parts_l), np.concatenate(parts_r)
    apart = (rows_l[:-1, 2] != rows_l[1:, 2]) | (rows_r[:-1, 2] != rows_r[1:, 2])
    first, _ = runs(rows_l[:, 0], rows_r[:, 0], step=rows_l[:, 1], apart=apart)
    if first.size == rows_l.shape[0]:
        return rows_l, rows_r
    out_l, out_r = rows_l[first], rows_r[first]
    out_l[:, 1] = out_r[:, 1] = np.add.reduceat(rows_l[:, 1], first)
    return out_l, out_r
