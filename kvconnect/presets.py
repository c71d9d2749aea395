"""Model-shaped KV caches for the demo and benchmarks: dense GQA, MLA-like and hybrid attention+Mamba.

Each preset allocates per-layer tensors exactly as an engine would hand them to `register_kv_caches`,
grouped into KV-cache groups (hybrid models have one block table per group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvconnect.kvgroups import KVGroup
from kvconnect.layout import KVCacheLayout, MambaPage


@dataclass(frozen=True)
class Preset:
    """The KV-cache shape of one model family."""

    name: str
    description: str
    attention_layers: int
    kv_heads: int
    head_content: int  # elements per token and head: 2*head_size when K and V are packed, the latent for MLA
    block_size: int
    dtype: torch.dtype
    mamba_layers: int = 0
    mamba_page: MambaPage | None = None
    # A Mamba state page per block of tokens (vLLM's all-blocks Mamba prefix caching), not one per request.
    state_every_block: bool = False

    @property
    def attention_page_bytes(self) -> int:
        """Bytes of one block of one attention layer."""
        return self.kv_heads * self.block_size * self.head_content * self.dtype.itemsize

    def blocks_for(self, tokens: int) -> list[int]:
        """Blocks one request of `tokens` tokens needs, per KV group (Mamba keeps one state block, or one per block)."""
        per_block = math.ceil(tokens / self.block_size)
        groups = [per_block] if self.attention_layers else []
        if self.mamba_layers:
            groups.append(per_block if self.state_every_block else 1)
        return groups

    def bytes_per_request(self, tokens: int) -> int:
        """Bytes one request of `tokens` tokens moves."""
        blocks = self.blocks_for(tokens)
        total = blocks[0] * self.attention_layers * self.attention_page_bytes if self.attention_layers else 0
        if self.mamba_layers:
            total += blocks[-1] * self.mamba_layers * self.mamba_page.page_size_bytes
        return total

    def allocate(self, num_blocks: int, layout: str = "LBHNC") -> tuple[dict[str, torch.Tensor], list[KVGroup]]:
        """Per-layer KV tensors of `num_blocks` blocks (attention pages in `layout`, a `KVCacheLayout`
        name: layers outermost, or blocks outermost so a block holds every layer) and their KV groups."""
        caches: dict[str, torch.Tensor] = {}
        groups = []
        if self.attention_layers:
            shape = (self.attention_layers, num_blocks, self.kv_heads, self.block_size, self.head_content)
            buf = torch.zeros(math.prod(shape), dtype=self.dtype)
            for i, view in enumerate(KVCacheLayout(layout).per_layer_views(buf, shape)):
                caches[f"model.layers.{i}.self_attn"] = view
            groups.append(KVGroup(layers=tuple(caches), label="attention"))
        if self.mamba_layers:
            names = [f"model.layers.{self.attention_layers + i}.mamba" for i in range(self.mamba_layers)]
            for name in names:
                caches[name] = torch.zeros(num_blocks, 1, 1, self.mamba_page.page_size_bytes, dtype=torch.int8)
            groups.append(KVGroup(layers=tuple(names), label="mamba", block_size=self.block_size))
        return caches, groups


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama3-8b", "Llama-3-8B-like dense GQA: 32 layers, 8 KV heads, head size 128, bf16",
               attention_layers=32, kv_heads=8, head_content=2 * 128, block_size=16, dtype=torch.bfloat16),
        Preset("llama3-70b-tp8", "Llama-3-70B-like, one TP=8 shard: 80 layers, 1 KV head, head size 128, bf16",
               attention_layers=80, kv_heads=1, head_content=2 * 128, block_size=16, dtype=torch.bfloat16),
        Preset("mla", "DeepSeek-like MLA: 61 layers, one 576-element latent per token, bf16",
               attention_layers=61, kv_heads=1, head_content=576, block_size=16, dtype=torch.bfloat16),
        Preset("hybrid", "hybrid attention+Mamba: 8 attention layers (8 KV heads, head size 128) and 24 Mamba "
               "layers whose conv and SSM states share a 64 KiB int8 page",
               attention_layers=8, kv_heads=8, head_content=2 * 128, block_size=16, dtype=torch.bfloat16,
               mamba_layers=24,
               mamba_page=MambaPage([(3, 2048), (16, 64, 16)], [torch.bfloat16, torch.bfloat16], 65536)),
        # The hybrid preset's two kinds of page apart, at equal bytes per block (8 layers of 64 KiB each),
        # so that a benchmark shows whether a Mamba page moves like an attention page.
        Preset("hybrid-attention", "the hybrid preset's attention pages alone: 8 layers of 64 KiB pages",
               attention_layers=8, kv_heads=8, head_content=2 * 128, block_size=16, dtype=torch.bfloat16),
        Preset("hybrid-mamba", "the hybrid preset's Mamba state pages alone: 8 layers of 64 KiB int8 pages, one "
               "state per block of tokens (all-blocks Mamba prefix caching)",
               attention_layers=0, kv_heads=8, head_content=2 * 128, block_size=16, dtype=torch.bfloat16,
               mamba_layers=8, state_every_block=True,
               mamba_page=MambaPage([(3, 2048), (16, 64, 16)], [torch.bfloat16, torch.bfloat16], 65536)),
    )
}
