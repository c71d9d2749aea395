"""KV-cache groups: the layers that share one block table, and the regions that hold each group's layers.

A hybrid model (attention and Mamba layers, or full and sliding-window attention) has several groups,
each with its own block ids per request; a plain model has one. kvconnect compares a group's kind
with the peer's and never interprets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Protocol, Sequence

from kvconnect.errors import LayoutError


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: the layers sharing its block table, its kind (compared, never interpreted)
    and its tokens per block (default: the connector's `block_size`)."""

    layers: tuple[str, ...]
    label: str = "kv"
    block_size: int | None = None


class Named(Protocol):
    """Anything that answers to layer names (a `kvconnect.regions.Region`)."""

    names: tuple[str, ...]


def resolve_groups(regions: Collection[Named], groups: Sequence[KVGroup] | None) -> list[list[int]]:
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
