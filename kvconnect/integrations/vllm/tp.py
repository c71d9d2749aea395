"""Tensor parallelism on vLLM: this worker's TP rank, and how each layer's pages split across ranks.

vLLM shards attention KV by KV head (a rank of a TP size above the head count holds one head,
replicated) and keeps an MLA latent whole on every rank. The split is described here, per layer,
from the registered tensor and its group's spec, for the core to pair pages between TP sizes
(`kvconnect.shards`). State layers (Mamba, short conv, GDN) get none: vLLM lays a hybrid model's
attention and state pages in tensors the groups share, one region read two ways, and a region has
one split. They move only between equal TP sizes; other pairs are refused naming both sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvconnect.shards import PageShards, attention, replicated

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def tp_size(vllm_config: VllmConfig, connector: str) -> int:
    """The engine's tensor-parallel size; ValueError naming `connector` for pipeline parallelism, which
    kvconnect does not map."""
    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        raise ValueError(f"{connector}: pipeline_parallel_size > 1 is not supported by kvconnect's connectors")
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def tp_rank() -> int:
    """This worker's rank in its tensor-parallel group (0 outside one)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError):  # no TP group initialised: a single-rank engine
        return 0


def layer_shards(kv_cache_config: KVCacheConfig | None, kv_caches: dict[str, torch.Tensor], total_heads: int,
                 layout: str) -> dict[str, PageShards]:
    """Per attention layer, how its registered pages split by KV head (`layout`: LBHNC or LBNHC)."""
    out: dict[str, PageShards] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", ()) or ():
        spec = group.kv_cache_spec
        for name in group.layer_names:
            tensor = kv_caches.get(name)
            if tensor is not None:
                split = _split(spec, tensor, total_heads, layout)
                if split is not None:
                    out[name] = split
    return out


def _split(spec: Any, tensor: torch.Tensor, total_heads: int, layout: str) -> PageShards | None:
    page = tensor[0].numel() * tensor.element_size()
    if type(spec).__name__ == "MLAAttentionSpec":
        return replicated(page)
    heads, tokens = getattr(spec, "num_kv_heads", None), getattr(spec, "block_size", None)
    if not heads or not tokens or getattr(spec, "tokens_per_state", 1) < 0 or page % (heads * tokens):
        return None
    dims = tuple(tensor.shape[1:3])
    if layout == "LBHNC" and dims == (heads, tokens):
        return attention(tokens, heads, page // (heads * tokens), total_heads, heads_outer=True)
    if layout == "LBNHC" and dims == (tokens, heads):
        return attention(tokens, heads, page // (heads * tokens), total_heads, heads_outer=False)
    return None
