"""Which TP split each region's blocks take: its layers' page splits, shifted to where each layer's page
starts in the region's block, per KV-cache group where the groups reading a region split it differently
(a hybrid's attention and state layers over one tensor). `kvconnect.regions` builds regions with it;
`kvconnect.shards` holds what a split is.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence, TypeVar

from kvconnect.errors import LayoutError
from kvconnect.shards import PageShards, Segment


class Placed(Protocol):
    """A region as far as its split goes (a `kvconnect.regions.Region`): its layer names and base address."""

    names: tuple[str, ...]
    base_addr: int


R = TypeVar("R", bound=Placed)


def assign_shards(regions: list[R], layers: Mapping[str, Placed], shards: Mapping[str, PageShards],
                  layer_groups: Sequence[Sequence[str]] | None = None) -> list[R]:
    """Each region with its split: its layers' segments, shifted to where each layer's page starts in the block.

    Aliased layers (one memory, several names) of one group must describe one split, or that group has
    none there: it then moves only between equal TP sizes. Where the groups reading a region describe
    different splits (`layer_groups`: the layers of each group), the region carries one per group.
    """
    unknown = sorted(set(shards) - set(layers))
    if unknown:
        raise LayoutError(f"shards describe layers that were not registered: {unknown[:5]}")
    group_of = {name: g for g, names in enumerate(layer_groups or ()) for name in names}
    out = []
    for r in regions:
        per_group: dict[int, list[str]] = {}
        for name in r.names:
            per_group.setdefault(group_of.get(name, -1), []).append(name)
        splits = {g: _split_of(r, names, layers, shards) for g, names in sorted(per_group.items())}
        if len(set(splits.values())) == 1:
            out.append(dataclasses.replace(r, shards=next(iter(splits.values()))))
        elif -1 in splits:  # layers in no group beside grouped ones: resolve_groups refuses the set
            out.append(r)
        else:
            out.append(dataclasses.replace(r, group_shards=tuple(splits.items())))
    return out


def _split_of(r: Placed, names: Sequence[str], layers: Mapping[str, Placed],
              shards: Mapping[str, PageShards]) -> PageShards | None:
    """The split these layers of region `r` describe together, None unless every memory has exactly one."""
    by_base: dict[int, set] = {}
    for name in names:
        segs = shards.get(name)
        by_base.setdefault(layers[name].base_addr, set()).add(None if segs is None else tuple(segs))
    if any(len(v) != 1 or None in v for v in by_base.values()):
        return None
    return tuple(Segment(s.offset + base - r.base_addr, s.repeat, s.stride, s.unit, s.total)
                 for base, v in sorted(by_base.items()) for s in next(iter(v)))
