"""Shared fixtures: KV caches shaped like real models, filled with reproducible bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvconnect.layout import KVCacheLayout


def random_bytes_(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill a tensor's storage with random bytes (any dtype) in place."""
    raw = tensor.view(torch.uint8) if tensor.is_contiguous() else None
    gen = torch.Generator().manual_seed(seed)
    if raw is not None:
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    else:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=gen).to(tensor.dtype))
    return tensor


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """Move bytes row by row between paired descriptor arrays, the way a transport would."""
    if dst.shape != src.shape:
        raise ValueError("descriptor arrays differ in shape")
    for (daddr, dlen, _), (saddr, slen, _) in zip(dst.tolist(), src.tolist()):
        if dlen != slen:
            raise ValueError("paired descriptors differ in length")
        ctypes.memmove(daddr, saddr, dlen)


def kv_cache(layout: KVCacheLayout, shape: tuple[int, int, int, int, int], dtype: torch.dtype,
             seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A flat buffer of random bytes and its per-layer `[B, H, N, C]` views in `layout`."""
    numel = int(np.prod(shape))
    buf = torch.empty(numel, dtype=dtype)
    random_bytes_(buf, seed)
    views = layout.per_layer_views(buf, shape)
    return buf, {f"model.layers.{i}.attn": v for i, v in enumerate(views)}


@pytest.fixture
def llama_like_cache() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A small Llama-shaped cache: 4 layers, 32 blocks, 2 KV heads, 16 tokens, K|V of head size 64, bf16."""
    return kv_cache(KVCacheLayout.LBHNC, (4, 32, 2, 16, 128), torch.bfloat16, seed=1)
