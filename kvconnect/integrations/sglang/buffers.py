"""SGLang's `KVArgs` as kvconnect regions: every buffer one region, every page (or aux row) one block.

SGLang hands a transfer backend raw pointers: per KV buffer (K of each layer, then V, or whatever
the pool holds) its address, its length and the bytes of one page; per aux buffer (first output
token, logprobs, ...) the same with one request's row as the item. Both sides of a pair build the
same list from the same model, so regions pair by position. Two KV groups: `kv` (page ids) and
`aux` (one row id per request).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvconnect.errors import LayoutError
from kvconnect.kvgroups import KVGroup


@dataclass(frozen=True)
class Buffers:
    """The tensors viewing SGLang's buffers (name -> (blocks, block bytes) uint8) and their groups."""

    tensors: dict[str, torch.Tensor]
    groups: tuple[KVGroup, KVGroup]


def _view(name: str, ptr: int, length: int, item: int) -> torch.Tensor:
    """A uint8 tensor of `length // item` blocks of `item` bytes over host memory at `ptr` (not copied)."""
    if item <= 0 or length < item or length % item:
        raise LayoutError(f"buffer {name}: {length} bytes is not a whole number of {item}-byte items")
    raw = (ctypes.c_uint8 * length).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(length // item, item)


def _named(prefix: str, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]) -> dict[str, torch.Tensor]:
    if not (len(ptrs) == len(lens) == len(items)) or not ptrs:
        raise LayoutError(f"{prefix} buffers: {len(ptrs)} pointers, {len(lens)} lengths, {len(items)} item sizes")
    return {f"{prefix}{i}": _view(f"{prefix}{i}", int(p), int(n), int(s))
            for i, (p, n, s) in enumerate(zip(ptrs, lens, items))}


def from_kv_args(kv_args: Any, device: str) -> Buffers:
    """The buffers SGLang's `KVArgs` names, as tensors kvconnect registers (host memory only)."""
    if device != "cpu":
        raise LayoutError(f"the kvconnect SGLang backend registers host memory only, this server runs on {device!r}")
    if getattr(kv_args, "state_types", None):
        raise LayoutError(f"state buffers ({kv_args.state_types}: Mamba, SWA, DSA, ...) are not moved by the "
                          "kvconnect SGLang backend; use a full-attention model")
    kv = _named("kv", kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens)
    aux = _named("aux", kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens)
    page_size = int(kv_args.page_size)
    groups = (KVGroup(layers=tuple(kv), label="kv", block_size=page_size),
              KVGroup(layers=tuple(aux), label="aux", block_size=1))
    return Buffers(tensors={**kv, **aux}, groups=groups)
