"""KVConnectOffload under tensor parallelism: the shard id of each rank, known to the scheduler too.

Every rank stores its own shard of a block under keys salted with its shard id
(`kvconnect.offload.keys.shard_id`: TP size, rank, and per layer the page split and the parts the
rank holds). The scheduler asks the lower tiers for every rank's keys, so it needs every rank's id
without the workers' tensors: the split is read off the KV-cache specs here, as `tp.layer_shards`
reads it off the registered tensors, and each worker checks at registration that the two agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from kvconnect.integrations.vllm.tp import layer_shards
from kvconnect.offload.keys import shard_id
from kvconnect.shards import PageShards, attention, replicated

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def spec_shards(kv_cache_config: KVCacheConfig, total_heads: int, layout: str) -> dict[str, PageShards | None]:
    """Per layer, how one rank's page splits by KV head, from the specs alone (None: not split by head)."""
    out: dict[str, PageShards | None] = {}
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            out[name] = _spec_split(group.kv_cache_spec, total_heads, layout)
    return out


def _spec_split(spec: Any, total_heads: int, layout: str) -> PageShards | None:
    page = int(spec.page_size_bytes)
    if type(spec).__name__ == "MLAAttentionSpec":
        return replicated(page)
    heads, tokens = getattr(spec, "num_kv_heads", None), getattr(spec, "block_size", None)
    if not heads or not tokens or getattr(spec, "tokens_per_state", 1) < 0 or page % (heads * tokens):
        return None
    return attention(tokens, heads, page // (heads * tokens), total_heads, heads_outer=layout == "LBHNC")


def rank_shards(kv_cache_config: KVCacheConfig, total_heads: int, layout: str, tp: int) -> list[bytes]:
    """Every rank's shard id, rank 0 first (`[b""]` at TP 1)."""
    pages = spec_shards(kv_cache_config, total_heads, layout)
    return [shard_id(tp, r, pages) for r in range(tp)]


def split_check(kv_cache_config: KVCacheConfig, total_heads: int, layout: str,
                connector: str) -> Callable[[dict[str, torch.Tensor]], None]:
    """A worker's check that its registered tensors split as the specs say (else the ids would lie)."""
    expected = spec_shards(kv_cache_config, total_heads, layout)

    def check(kv_caches: dict[str, torch.Tensor]) -> None:
        for name, split in layer_shards(kv_cache_config, kv_caches, total_heads, layout).items():
            if expected.get(name) != split:
                raise ValueError(f"{connector}: layer {name}'s registered pages split as {split}, its KV-cache "
                                 f"spec says {expected.get(name)}; this layout is not supported with TP")

    return check
