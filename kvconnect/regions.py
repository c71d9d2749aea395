"""Registered KV-cache memory as regions, and block ids turned into transfer descriptors.

A region is base address + block count + bytes per block + block stride: whatever a layer holds
(attention K/V pages, an MLA latent, a Mamba state page) is moved as opaque bytes. Descriptor arrays
are `(N, 3)` uint64 rows `(addr, nbytes, device_id)`, built with numpy and never with a Python loop
per block or per layer.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from kvconnect import wire
from kvconnect.errors import BlockRangeError, LayoutError
from kvconnect.shards import PageShards, Segment, assign_shards

BlockIds = Sequence[int] | np.ndarray | torch.Tensor
_EMPTY = np.empty((0, 3), dtype=np.uint64)


class MemoryKind(str, enum.Enum):
    """Where a region lives, named as transports name it."""

    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class Region:
    """One block-addressed span of memory: block `i` is `block_bytes` at `base_addr + i * block_stride`."""

    names: tuple[str, ...]
    base_addr: int
    num_blocks: int
    block_bytes: int
    block_stride: int
    device_id: int
    memory_kind: MemoryKind
    # How a block splits across TP ranks (kvconnect.shards); None: not described, TP sizes must match.
    shards: PageShards | None = None

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_bytes <= 0:
            raise LayoutError(f"region {self.label}: needs positive num_blocks and block_bytes")
        if self.base_addr < 0 or self.device_id < 0:
            raise LayoutError(f"region {self.label}: negative base address or device id")
        if self.num_blocks > 1 and self.block_stride < self.block_bytes:
            raise LayoutError(
                f"region {self.label}: block stride {self.block_stride} is smaller than a block "
                f"({self.block_bytes} bytes), so blocks would overlap"
            )

    @property
    def label(self) -> str:
        """A short name for messages: the first layer name, with a count of aliases."""
        if not self.names:
            return "<unnamed>"
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]} (+{len(self.names) - 1} aliases)"

    @property
    def contiguous(self) -> bool:
        """Blocks are back to back, so a run of consecutive block ids is one run of bytes."""
        return self.block_stride == self.block_bytes or self.num_blocks == 1

    @property
    def span_bytes(self) -> int:
        """Bytes from the first byte of block 0 to the last byte of the last block."""
        return (self.num_blocks - 1) * self.block_stride + self.block_bytes


def _block_is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """The elements of a tensor with this shape and these strides form one gap-free run."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _region_of(name: str, tensor: torch.Tensor) -> Region:
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"layer {name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < 1 or tensor.numel() == 0:
        raise LayoutError(f"layer {name}: an empty or 0-d tensor has no blocks (shape {tuple(tensor.shape)})")
    if tensor.device.type == "cpu":
        kind, device_id = MemoryKind.DRAM, 0
    elif tensor.device.type == "cuda":
        kind, device_id = MemoryKind.VRAM, tensor.device.index or 0
    else:
        raise LayoutError(f"layer {name}: unsupported device {tensor.device}")
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if not _block_is_dense(shape[1:], strides[1:]):
        raise LayoutError(
            f"layer {name}: the bytes of one block are not one contiguous run "
            f"(shape {shape}, element strides {strides}); kvconnect needs blocks-first pages"
        )
    itemsize = tensor.element_size()
    block_bytes = math.prod(shape[1:]) * itemsize
    block_stride = strides[0] * itemsize if shape[0] > 1 else block_bytes
    if shape[0] > 1 and block_stride < block_bytes:
        raise LayoutError(
            f"layer {name}: blocks are not outermost (dim 0 stride {block_stride} bytes is smaller than "
            f"a block of {block_bytes} bytes; shape {shape}, element strides {strides})"
        )
    return Region((name,), tensor.data_ptr(), shape[0], block_bytes, block_stride, device_id, kind)


def _merge_aliases(regions: list[Region]) -> list[Region]:
    """Layers viewing the same blocks (same base, stride, count) become one region moving the widest block."""
    merged: dict[tuple, Region] = {}
    for r in regions:
        key = (r.memory_kind, r.device_id, r.base_addr, r.num_blocks, r.block_stride)
        old = merged.get(key)
        if old is None:
            merged[key] = r
        else:
            merged[key] = Region(
                old.names + r.names, r.base_addr, r.num_blocks, max(old.block_bytes, r.block_bytes),
                r.block_stride, r.device_id, r.memory_kind,
            )
    return list(merged.values())


def _merge_layers(regions: list[Region], layer_groups: Sequence[Sequence[str]]) -> list[Region]:
    """Per-layer views of a blocks-outermost buffer, whose pages follow each other inside every block,
    become one region per run of layers of one group: a block of all those layers is then one run of
    bytes, moved with one descriptor instead of one per layer."""
    owner = {name: g for g, names in enumerate(layer_groups) for name in names}
    runs: dict[tuple, list[Region]] = {}
    out: list[Region] = []
    for r in regions:
        groups = {owner.get(n) for n in r.names}
        if len(groups) != 1 or None in groups or r.num_blocks < 2 or r.block_stride <= r.block_bytes:
            out.append(r)  # shared by groups, or already one run per block: nothing to merge
            continue
        runs.setdefault((groups.pop(), r.memory_kind, r.device_id, r.num_blocks, r.block_stride), []).append(r)
    for members in runs.values():
        members.sort(key=lambda r: r.base_addr)
        run = [members[0]]
        for r in members[1:] + [None]:
            end = run[-1].base_addr + run[-1].block_bytes
            if r is not None and r.base_addr == end and end + r.block_bytes - run[0].base_addr <= r.block_stride:
                run.append(r)
                continue
            first = run[0]
            out.append(Region(tuple(n for m in run for n in m.names), first.base_addr, first.num_blocks,
                              sum(m.block_bytes for m in run), first.block_stride, first.device_id, first.memory_kind))
            run = [r]
    return out


def _check_disjoint(regions: Sequence[Region]) -> None:
    """Refuse regions whose blocks share bytes: moving both would move some bytes twice, inconsistently."""
    if len(regions) < 2:
        return
    base = np.array([r.base_addr for r in regions], dtype=np.int64)
    end = base + np.array([r.span_bytes for r in regions], dtype=np.int64)
    stride = np.array([r.block_stride for r in regions], dtype=np.int64)
    nbytes = np.array([r.block_bytes for r in regions], dtype=np.int64)
    dev = np.array([hash((r.memory_kind, r.device_id)) for r in regions], dtype=np.int64)
    i, j = np.triu_indices(len(regions), k=1)
    overlap = (dev[i] == dev[j]) & (base[i] < end[j]) & (base[j] < end[i])
    # Per-layer strided views of one buffer interleave: same stride, windows disjoint within a stride.
    lo = np.where(base[i] <= base[j], i, j)
    hi = np.where(base[i] <= base[j], j, i)
    d = (base[hi] - base[lo]) % np.maximum(stride[lo], 1)
    interleaved = (stride[i] == stride[j]) & (d >= nbytes[lo]) & (d + nbytes[hi] <= stride[lo])
    bad = np.flatnonzero(overlap & ~interleaved)
    if bad.size:
        a, b = regions[i[bad[0]]], regions[j[bad[0]]]
        raise LayoutError(f"layers {a.label} and {b.label} overlap in memory without being the same blocks")


def _as_ids(block_ids: BlockIds, what: str = "block ids") -> np.ndarray:
    """Block ids as a 1-D int64 array, refusing anything that is not an integer."""
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().cpu().numpy()
    arr = np.asarray(block_ids)
    if arr.ndim != 1:
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        raise BlockRangeError(f"{what} must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind == "u":
        if arr.max() > np.iinfo(np.int64).max:
            pos = int(np.argmax(arr > np.iinfo(np.int64).max))
            raise BlockRangeError(f"{what}: id {arr[pos]} at position {pos} is out of range")
        return arr.astype(np.int64)
    if arr.dtype.kind != "i":
        values = list(block_ids) if isinstance(block_ids, (list, tuple)) else arr.tolist()
        pos = next((p for p, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, int)), 0)
        raise BlockRangeError(f"{what} must be integers: {values[pos]!r} at position {pos}")
    return arr.astype(np.int64, copy=False)


def _runs(ids: np.ndarray, *more: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of runs where every id sequence goes up by exactly one."""
    step = np.diff(ids) != 1
    for other in more:
        step |= np.diff(other) != 1
    starts = np.concatenate(([0], np.flatnonzero(step) + 1))
    lengths = np.diff(np.append(starts, ids.size))
    return starts, lengths


class RegionSet:
    """The regions one worker registered, and the descriptor math over them."""

    def __init__(self, regions: Sequence[Region]):
        self.regions: tuple[Region, ...] = tuple(regions)
        if not self.regions:
            raise LayoutError("a RegionSet needs at least one region")
        _check_disjoint(self.regions)
        u64 = np.uint64
        self._base = np.array([r.base_addr for r in self.regions], dtype=u64)
        self._stride = np.array([r.block_stride for r in self.regions], dtype=u64)
        self._bytes = np.array([r.block_bytes for r in self.regions], dtype=u64)
        self._dev = np.array([r.device_id for r in self.regions], dtype=u64)
        self._num_blocks = np.array([r.num_blocks for r in self.regions], dtype=np.int64)
        self._contiguous = np.array([r.contiguous for r in self.regions], dtype=bool)
        self._all = np.arange(len(self.regions))
        self._tensors: tuple[torch.Tensor, ...] = ()

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor],
                       layer_groups: Sequence[Sequence[str]] | None = None,
                       shards: Mapping[str, PageShards] | None = None) -> RegionSet:
        """One region per layer tensor (aliases merged), or one for a single cross-layer tensor.

        With `layer_groups` (the layers of each KV-cache group), per-layer views that lie side by side
        in every block of one buffer (a blocks-outermost layout) merge into one cross-layer region per
        group. `shards` describes, per layer, how its pages split across TP ranks (kvconnect.shards).
        """
        if not kv_caches:
            raise LayoutError("register_kv_caches got no tensors")
        layers = [_region_of(name, t) for name, t in kv_caches.items()]
        regions = _merge_aliases(layers)
        if layer_groups is not None:
            regions = _merge_layers(regions, layer_groups)
        if shards:
            regions = assign_shards(regions, {r.names[0]: r for r in layers}, shards)
        rs = cls(regions)
        # A transport keeps raw addresses: the tensors must outlive the set, or it would write freed memory.
        rs._tensors = tuple(kv_caches.values())
        return rs

    def __getstate__(self) -> dict:
        # Geometry only: pickling the tensors would move their storage into shared memory (torch's
        # reducers do so in place), leaving registered addresses pointing at memory no longer used.
        return {**self.__dict__, "_tensors": ()}

    def __len__(self) -> int:
        return len(self.regions)

    def __iter__(self) -> Iterator[Region]:
        return iter(self.regions)

    def __getitem__(self, index: int) -> Region:
        return self.regions[index]

    def __repr__(self) -> str:
        return f"RegionSet({len(self.regions)} regions, {self.total_bytes} bytes)"

    @property
    def names(self) -> list[str]:
        """Every layer name, in region order."""
        return [n for r in self.regions for n in r.names]

    @property
    def total_bytes(self) -> int:
        """Bytes of every block of every region."""
        return int(np.sum(self._bytes * self._num_blocks.astype(np.uint64)))

    def _select(self, regions: Sequence[int] | np.ndarray | None) -> np.ndarray:
        if regions is None:
            return self._all
        sel = np.asarray(regions, dtype=np.int64).reshape(-1)
        if sel.size and (sel.min() < 0 or sel.max() >= len(self.regions)):
            raise LayoutError(f"region index out of range 0..{len(self.regions) - 1}: {sel.tolist()}")
        return sel

    def validate(self, block_ids: BlockIds, regions: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Block ids as int64 after checking each is inside every selected region, else BlockRangeError."""
        ids = _as_ids(block_ids)
        sel = self._select(regions)
        if ids.size == 0 or sel.size == 0:
            return ids
        limits = self._num_blocks[sel]
        smallest = int(np.argmin(limits))
        bad = (ids < 0) | (ids >= limits[smallest])
        if bad.any():
            pos = int(np.argmax(bad))
            region = self.regions[int(sel[smallest])]
            raise BlockRangeError(
                f"block id {int(ids[pos])} at position {pos} is out of range for region {region.label} "
                f"(num_blocks={region.num_blocks})"
            )
        return ids

    def descriptors(self, block_ids: BlockIds, regions: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """`(N, 3)` uint64 rows `(addr, nbytes, device_id)` for these blocks in the selected regions."""
        ids = self.validate(block_ids, regions)
        sel = self._select(regions)
        if ids.size == 0 or sel.size == 0:
            return _EMPTY.copy()
        starts, lengths = _runs(ids)
        return _build(self, sel, ids, starts, lengths, self._contiguous[sel])

    def registration(self) -> np.ndarray:
        """`(R, 3)` uint64 rows `(addr, nbytes, device_id)` covering every region once, overlaps merged."""
        rows = sorted(
            (r.memory_kind.value, r.device_id, r.base_addr, r.base_addr + r.span_bytes) for r in self.regions
        )
        merged: list[list] = []
        for kind, dev, start, end in rows:
            if merged and merged[-1][0] == kind and merged[-1][1] == dev and start <= merged[-1][3]:
                merged[-1][3] = max(merged[-1][3], end)
            else:
                merged.append([kind, dev, start, end])
        return np.array([(s, e - s, d) for _, d, s, e in merged], dtype=np.uint64).reshape(-1, 3)

    def memory_kinds(self) -> set[MemoryKind]:
        """The memory kinds present in this set."""
        return {r.memory_kind for r in self.regions}

    def to_wire(self) -> tuple[wire.RegionMeta, ...]:
        """The regions as they cross the wire (geometry only)."""
        return tuple(wire.RegionMeta(names=tuple(r.names), base_addr=int(r.base_addr), num_blocks=int(r.num_blocks),
                                     block_bytes=int(r.block_bytes), block_stride=int(r.block_stride),
                                     device_id=int(r.device_id), memory_kind=r.memory_kind.value,
                                     shards=None if r.shards is None else tuple(
                                         wire.SegmentMeta(offset=s.offset, repeat=s.repeat, stride=s.stride,
                                                          unit=s.unit, total=s.total) for s in r.shards))
                     for r in self.regions)

    @classmethod
    def from_wire(cls, regions: Sequence[wire.RegionMeta]) -> RegionSet:
        """A peer's regions from decoded wire regions; WireError if they do not make sense together."""
        try:
            return cls([Region(tuple(r.names), r.base_addr, r.num_blocks, r.block_bytes, r.block_stride, r.device_id,
                               MemoryKind(r.memory_kind),
                               None if r.shards is None else tuple(
                                   Segment(s.offset, s.repeat, s.stride, s.unit, s.total) for s in r.shards))
                        for r in regions])
        except (LayoutError, ValueError, OverflowError) as exc:
            raise wire.WireError(f"peer regions are invalid: {exc}") from None


def _build(
    rs: RegionSet, sel: np.ndarray, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, mergeable: np.ndarray
) -> np.ndarray:
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
    first = first.astype(np.uint64)
    count = count.astype(np.uint64)
    out[:, 0] = (rs._base[sel, None] + first[None, :] * rs._stride[sel, None]).ravel()
    out[:, 1] = (count[None, :] * rs._bytes[sel, None]).ravel()
    out[:, 2] = np.repeat(rs._dev[sel], first.size)
    return out


def pair_descriptors(
    local: RegionSet,
    local_ids: BlockIds,
    remote: RegionSet,
    remote_ids: BlockIds,
    regions: Sequence[int] | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Matched local/remote descriptor arrays: row k of one moves to row k of the other."""
    if len(local) != len(remote):
        raise LayoutError(f"local has {len(local)} regions, remote has {len(remote)}")
    sel = local._select(regions)
    differ = np.flatnonzero(local._bytes[sel] != remote._bytes[sel])
    if differ.size:
        k = int(sel[differ[0]])
        raise LayoutError(
            f"region {k} ({local.regions[k].label}): local blocks are {local.regions[k].block_bytes} bytes, "
            f"remote blocks are {remote.regions[k].block_bytes} bytes"
        )
    lids = local.validate(local_ids, sel)
    rids = remote.validate(remote_ids, sel)
    if lids.size != rids.size:
        raise BlockRangeError(f"{lids.size} local block ids but {rids.size} remote block ids")
    if lids.size == 0 or sel.size == 0:
        return _EMPTY.copy(), _EMPTY.copy()
    # A run is one descriptor only where it is back to back on both sides.
    both = local._contiguous[sel] & remote._contiguous[sel]
    starts, lengths = _runs(lids, rids)
    return _build(local, sel, lids, starts, lengths, both), _build(remote, sel, rids, starts, lengths, both)


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: the layers sharing its block table, its kind (compared, never interpreted)
    and its tokens per block (default: the connector's `block_size`)."""

    layers: tuple[str, ...]
    label: str = "kv"
    block_size: int | None = None


def resolve_groups(regions: RegionSet, groups: Sequence[KVGroup] | None) -> list[list[int]]:
    """Region indices per group: the regions holding each group's layers (a shared region in each)."""
    if groups is None:
        return [list(range(len(regions)))]
    where = {name: k for k, r in enumerate(regions) for name in r.names}
    out = []
    for g, group in enumerate(groups):
        missing = [n for n in group.layers if n not in where]
        if missing or not group.layers:
            raise LayoutError(f"group {g} ({group.label}) names layers that were not registered: {missing[:5]}")
        out.append(sorted({where[n] for n in group.layers}))
    named = {n for group in groups for n in group.layers}
    unnamed = [n for n in where if n not in named]
    if unnamed:
        raise LayoutError(f"registered layers in no group (they would never move): {unnamed[:5]}")
    return out
