"""SGLang's `KVArgs` as kvconnect regions: every buffer one region, every page (or aux row) one block.

SGLang hands a transfer backend raw pointers: per KV buffer (K of each layer, then V, or whatever
the pool holds) its address, its length and the bytes of one page; per aux buffer (first output
token, logprobs, ...) the same with one request's row as the item. Both sides of a pair build the
same list from the same model, so regions pair by position. Two KV groups: `kv` (page ids) and
`aux` (one row id per request).

With tensor parallelism each rank's KV page holds its own KV heads, tokens outer and heads inner
(`[page_size, heads, head_dim]`), so a page splits by head (`kvconnect.shards.attention`) and pairs
with ranks of any TP size the heads divide; an aux row is the same on every rank (replicated).
An MLA latent is not described: such servers pair with equal TP sizes only.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvconnect.errors import LayoutError
from kvconnect.kvgroups import KVGroup
from kvconnect.shards import PageShards, attention, owned, replicated


@dataclass(frozen=True)
class Heads:
    """The KV heads one rank's pages hold: `count` of the model's `total`, from global head `first`."""

    count: int
    total: int
    first: int


@dataclass(frozen=True)
class Buffers:
    """The tensors viewing SGLang's buffers (name -> (blocks, block bytes) uint8) and their groups."""

    tensors: dict[str, torch.Tensor]
    groups: tuple[KVGroup, KVGroup]
    page_size: int = 1
    heads: Heads | None = None  # None: the pages are not split by head (MLA), TP sizes must match

    def shards(self) -> dict[str, PageShards]:
        """How each buffer's pages split across TP ranks (kvconnect.shards); empty when not described."""
        if self.heads is None:
            return {}
        kv, aux = self.groups
        out = {name: replicated(int(self.tensors[name].shape[1])) for name in aux.layers}
        for name in kv.layers:
            item = int(self.tensors[name].shape[1])
            out[name] = attention(self.page_size, self.heads.count, item // (self.page_size * self.heads.count),
                                  self.heads.total, heads_outer=False)
        return out


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


def heads_of(count: int, total: int, page_size: int, tp: int, rank: int, items: Sequence[int]) -> Heads:
    """The heads rank `rank` of `tp` holds (`count` of the model's `total`), checked against the page sizes."""
    first, expect = owned(total, tp, rank)
    if count != expect:
        raise LayoutError(f"rank {rank} of TP {tp} holds {count} of {total} KV heads, kvconnect expects {expect}")
    odd = sorted({int(n) for n in items if int(n) % (page_size * count)})
    if odd:
        raise LayoutError(f"KV pages of {odd[0]} bytes do not hold {page_size} tokens of {count} heads")
    return Heads(count=count, total=total, first=first)


def from_kv_args(kv_args: Any, device: str, tp: int = 1, rank: int = 0, mla: bool = False,
                 kv_heads: tuple[int, int] | None = None) -> Buffers:
    """The buffers SGLang's `KVArgs` names, as tensors kvconnect registers (host memory only), for rank
    `rank` of attention TP `tp`; `kv_heads`: (this rank's, the model's) KV head counts where `KVArgs`
    does not carry them (SGLang's decode fills them in after its manager started)."""
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
    heads = None
    if not mla:
        count, total = kv_heads or (int(kv_args.kv_head_num), int(kv_args.total_kv_head_num))
        heads = heads_of(count, total, page_size, tp, rank, kv_args.kv_item_lens)
    return Buffers(tensors={**kv, **aux}, groups=groups, page_size=page_size, heads=heads)
