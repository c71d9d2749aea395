"""vLLM's KV-cache groups as kvconnect sees them: layer names, an opaque label, tokens per block.

A group is the set of layers that share one block table. kvconnect registers regions per layer and
moves each group's blocks in its own regions; it never interprets a group's kind beyond comparing
the label with the peer's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnect.connector import KVGroup

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def kv_groups(kv_cache_config: KVCacheConfig | None, connector: str) -> list[KVGroup]:
    """The transferable KV-cache groups; refuses what the adapter cannot move yet (Mamba state pages)."""
    if kv_cache_config is None:
        return []
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if "Mamba" in kind or not hasattr(spec, "num_kv_heads"):
            raise ValueError(
                f"{connector} does not support KV-cache group of {kind} yet (hybrid attention + Mamba "
                "models): kvconnect's vLLM adapter moves attention KV pages only. Use a non-hybrid model.")
        groups.append(KVGroup(layers=tuple(g.layer_names), label=kind, block_size=int(spec.block_size)))
    return groups
