"""Registered KV-cache memory as regions: the geometry of every block a worker can move.

A region is base address + block count + bytes per block + block stride: whatever a layer holds
(attention K/V pages, an MLA latent, a Mamba state page) is moved as opaque bytes. Layers that view
the same blocks, or lie side by side in every block of one buffer, merge into one region. Turning
block ids into transfer descriptors is `kvconnect.descriptors`' work; KV-cache groups are
`kvconnect.kvgroups`'; which TP split a region's blocks take, `kvconnect.region_splits`'.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from kvconnect import wire
from kvconnect.errors import LayoutError
from kvconnect.kvgroups import KVGroup, resolve_groups  # noqa: F401  (re-exported: they lived here)
from kvconnect.region_splits import assign_shards  # noqa: F401  (re-exported: it lived here)
from kvconnect.shards import PageShards, Segment

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


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
    # Where the KV-cache groups sharing this region read its blocks differently (a hybrid's attention and
    # state layers over one tensor: each block belongs to one group at a time), the split per group index
    # of every group that reads it, None where that group's is not described; empty otherwise.
    group_shards: tuple[tuple[int, PageShards | None], ...] = ()

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

    def split(self, group: int) -> PageShards | None:
        """How the blocks group `group` reads here split across TP ranks."""
        for g, segs in self.group_shards:
            if g == group:
                return segs
        return self.shards

    @property
    def splits(self) -> tuple[PageShards | None, ...]:
        """Every way this region's blocks split, one per group that reads them differently."""
        return tuple(s for _, s in self.group_shards) if self.group_shards else (self.shards,)

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


class RegionSet:
    """The regions one worker registered, with their geometry as numpy arrays (one entry per region)."""

    def __init__(self, regions: Sequence[Region]):
        self.regions: tuple[Region, ...] = tuple(regions)
        if not self.regions:
            raise LayoutError("a RegionSet needs at least one region")
        _check_disjoint(self.regions)
        u64 = np.uint64
        self.base_addrs = _frozen([r.base_addr for r in self.regions], u64)
        self.block_strides = _frozen([r.block_stride for r in self.regions], u64)
        self.block_sizes = _frozen([r.block_bytes for r in self.regions], u64)
        self.device_ids = _frozen([r.device_id for r in self.regions], u64)
        self.block_counts = _frozen([r.num_blocks for r in self.regions], np.int64)
        self.contiguous = _frozen([r.contiguous for r in self.regions], bool)
        self._all = _frozen(range(len(self.regions)), np.int64)
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
            regions = assign_shards(regions, {r.names[0]: r for r in layers}, shards, layer_groups)
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
        return int(np.sum(self.block_sizes * self.block_counts.astype(np.uint64)))

    def indices(self, regions: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Region indices as int64 (None: every region), after checking each names a region of this set."""
        if regions is None:
            return self._all
        sel = np.array(regions, dtype=np.int64).reshape(-1)  # a copy: the caller cannot change it once checked
        if sel.size and (sel.min() < 0 or sel.max() >= len(self.regions)):
            raise LayoutError(f"region index out of range 0..{len(self.regions) - 1}: {sel.tolist()}")
        if np.unique(sel).size != sel.size:  # a region named twice would move its blocks twice
            raise LayoutError(f"a region index is named twice: {sel.tolist()}")
        sel.flags.writeable = False
        return sel

    def __getattr__(self, name: str) -> object:
        if name in _MOVED_METHODS:
            raise AttributeError(f"RegionSet.{name} moved: use {_MOVED_METHODS[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
                                     shards=_segments_to_wire(r.shards),
                                     group_shards=tuple(wire.GroupSplitMeta(group=g, shards=_segments_to_wire(s))
                                                        for g, s in r.group_shards))
                     for r in self.regions)

    @classmethod
    def from_wire(cls, regions: Sequence[wire.RegionMeta]) -> RegionSet:
        """A peer's regions from decoded wire regions; WireError if they do not make sense together."""
        try:
            return cls([Region(tuple(r.names), r.base_addr, r.num_blocks, r.block_bytes, r.block_stride, r.device_id,
                               MemoryKind(r.memory_kind), _segments_from_wire(r.shards),
                               tuple((gs.group, _segments_from_wire(gs.shards)) for gs in r.group_shards))
                        for r in regions])
        except (LayoutError, ValueError, OverflowError) as exc:
            raise wire.WireError(f"peer regions are invalid: {exc}") from None


def _segments_to_wire(segments: PageShards | None) -> tuple[wire.SegmentMeta, ...] | None:
    if segments is None:
        return None
    return tuple(wire.SegmentMeta(offset=s.offset, repeat=s.repeat, stride=s.stride, unit=s.unit, total=s.total)
                 for s in segments)


def _segments_from_wire(segments: Sequence[wire.SegmentMeta] | None) -> PageShards | None:
    return None if segments is None else tuple(Segment(s.offset, s.repeat, s.stride, s.unit, s.total) for s in segments)


def _frozen(values, dtype) -> np.ndarray:
    out = np.array(list(values), dtype=dtype)
    out.flags.writeable = False
    return out


_MOVED_METHODS = {"validate": "kvconnect.descriptors.check_ids(region_set, block_ids, regions)",
                  "descriptors": "kvconnect.descriptors.block_rows(region_set, block_ids, regions)"}


def __getattr__(name: str) -> object:
    """Names that moved out of this module fail with a message naming their new home."""
    if name == "pair_descriptors":
        raise ImportError("kvconnect.regions.pair_descriptors moved to kvconnect.descriptors.pair_descriptors")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
