"""KV-cache layout model: stride orders, K/V pages, Mamba state pages, layout fingerprints.

Pure functions over shapes and tensor views; nothing here does I/O or copies data.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from typing import Any, Sequence

import torch

from kvconnect.errors import LayoutError

# The logical dimensions of a KV cache: Layer, Block, Head, token-in-block (N), Content.
LOGICAL_DIMS = "LBHNC"


class KVCacheLayout(str, enum.Enum):
    """Physical order (outermost first) of the logical `[L, B, H, N, C]` KV-cache shape."""

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"

    @property
    def layers_outermost(self) -> bool:
        """Each layer owns one contiguous slab (one region per layer)."""
        return self.value[0] == "L"

    @property
    def blocks_outermost(self) -> bool:
        """Each block holds all layers (one cross-layer region)."""
        return self.value[0] == "B"

    @property
    def block_contiguous(self) -> bool:
        """One layer's `[H, N, C]` bytes of one block form one contiguous run."""
        return set(self.value[2:]) == {"H", "N", "C"}

    def strides(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Element strides for a logical `[L, B, H, N, C]` shape stored in this physical order."""
        if len(shape) != 5:
            raise LayoutError(f"logical KV-cache shape must have 5 dims [L, B, H, N, C], got {tuple(shape)}")
        size = dict(zip(LOGICAL_DIMS, shape))
        stride: dict[str, int] = {}
        step = 1
        for dim in reversed(self.value):
            stride[dim] = step
            step *= size[dim]
        return tuple(stride[d] for d in LOGICAL_DIMS)

    def per_layer_views(self, buffer: torch.Tensor, shape: Sequence[int]) -> list[torch.Tensor]:
        """Split one flat buffer holding `[L, B, H, N, C]` in this order into per-layer `[B, H, N, C]` views."""
        numel = math.prod(shape)
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() != numel:
            raise LayoutError(f"buffer must be a contiguous 1-D tensor of {numel} elements for shape {tuple(shape)}")
        s = self.strides(shape)
        full = buffer.as_strided(tuple(shape), s)
        return [full[layer] for layer in range(shape[0])]


def split_kv(pages: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views (no copy) of pages that pack K and V in the last (content) dim."""
    if pages.dim() < 1 or pages.shape[-1] != 2 * head_size:
        raise LayoutError(
            f"K/V pages must have content dim 2*head_size={2 * head_size}, got shape {tuple(pages.shape)}"
        )
    return pages[..., :head_size], pages[..., head_size:]


class MambaPage:
    """The byte layout of a Mamba/SSM page: states packed back to back from byte 0 of an int8 page."""

    def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], page_size_bytes: int):
        if len(shapes) != len(dtypes):
            raise LayoutError(f"MambaPage got {len(shapes)} shapes but {len(dtypes)} dtypes")
        if not shapes:
            raise LayoutError("MambaPage needs at least one state")
        if page_size_bytes <= 0:
            raise LayoutError(f"page_size_bytes must be positive, got {page_size_bytes}")
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self.dtypes = tuple(dtypes)
        self.page_size_bytes = int(page_size_bytes)
        offsets = []
        offset = 0
        for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes)):
            if not isinstance(dtype, torch.dtype):
                raise LayoutError(f"state {i}: dtype must be a torch.dtype, got {dtype!r}")
            if any(d <= 0 for d in shape):
                raise LayoutError(f"state {i}: shape {shape} has a non-positive dim")
            itemsize = dtype.itemsize
            if offset % itemsize:
                # A misaligned typed view would need a copy, which would break write-through.
                raise LayoutError(
                    f"state {i} ({dtype}) starts at byte {offset}, not a multiple of its item size {itemsize}"
                )
            offsets.append(offset)
            offset += math.prod(shape) * itemsize
        self.offsets = tuple(offsets)
        self.state_bytes = offset
        if self.state_bytes > self.page_size_bytes:
            raise LayoutError(f"states need {self.state_bytes} bytes but the page has {self.page_size_bytes}")

    def unpack(self, pages: torch.Tensor) -> list[torch.Tensor]:
        """One `[num_blocks, *shape]` view per state over a raw int8 `[num_blocks, 1, 1, page]` page view."""
        if pages.dtype not in (torch.int8, torch.uint8):
            raise LayoutError(f"Mamba pages must be int8 or uint8, got {pages.dtype}")
        if pages.dim() != 4 or pages.shape[1] != 1 or pages.shape[2] != 1:
            raise LayoutError(f"Mamba pages must have shape [num_blocks, 1, 1, page_bytes], got {tuple(pages.shape)}")
        if pages.shape[3] != self.page_size_bytes:
            raise LayoutError(f"page has {pages.shape[3]} bytes, MambaPage expects {self.page_size_bytes}")
        if pages.stride(3) != 1:
            raise LayoutError("the bytes of one Mamba page must be contiguous (last-dim stride 1)")
        flat = pages[:, 0, 0, :]
        views = []
        for i, (shape, dtype, offset) in enumerate(zip(self.shapes, self.dtypes, self.offsets)):
            itemsize = dtype.itemsize
            if flat.shape[0] > 1 and flat.stride(0) % itemsize:
                raise LayoutError(f"state {i} ({dtype}): page stride {flat.stride(0)} is not a multiple of {itemsize}")
            if (flat.storage_offset() + offset) % itemsize:
                raise LayoutError(f"state {i} ({dtype}): page start is not aligned to {itemsize} bytes")
            nbytes = math.prod(shape) * itemsize
            raw = flat[:, offset : offset + nbytes]
            views.append(raw.view(dtype).view(flat.shape[0], *shape))
        return views


def _canonical(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise LayoutError(f"cannot fingerprint a value of type {type(value).__name__}")


def fingerprint(**fields: Any) -> str:
    """A stable short hash of layout facts (enum, dtypes, shapes, sizes), equal across processes and runs."""
    text = json.dumps(_canonical(fields), sort_keys=True, separators=(",", ":"))
    return "kvl1-" + hashlib.sha256(text.encode()).hexdigest()[:32]
