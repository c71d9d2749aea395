"""A test-only window on the bytes a P/D request moves: set KVCONNECT_DUMP_DIR to enable it.

With the variable set, a prefill worker writes the pages of every request it holds, right after the
forward pass that computed them, and a decode worker writes the pages of every load it reports done,
before vLLM reads them: `{dir}/{held|loaded}-{producer request id}[-rank{r}].npz` (the rank with
tensor parallelism), one `(blocks, page bytes)` uint8 array per group and layer. Comparing the two
files is a byte check of the whole path, for models whose greedy tokens are too noisy to prove a
transfer right (random hybrid models). Without the variable nothing here runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kvconnect.kvgroups import KVGroup

ENV = "KVCONNECT_DUMP_DIR"


class PageDump:
    """Writes a request's pages, per group and layer, to one .npz file."""

    def __init__(self, directory: str, kv_caches: dict[str, torch.Tensor], groups: Sequence[KVGroup],
                 rank: int | None = None):
        self.suffix = "" if rank is None else f"-rank{rank}"  # TP ranks each write their own shard
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.caches = kv_caches
        self.groups = list(groups) or [KVGroup(layers=tuple(kv_caches))]

    @classmethod
    def from_env(cls, kv_caches: dict[str, torch.Tensor], groups: Sequence[KVGroup],
                 rank: int | None = None) -> PageDump | None:
        """A dump when KVCONNECT_DUMP_DIR is set, else None."""
        directory = os.environ.get(ENV)
        return cls(directory, kv_caches, groups, rank) if directory else None

    def write(self, kind: str, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """Write the pages of `block_ids` (one list per group) as `{kind}-{request_id}.npz`."""
        arrays = {}
        for g, (group, ids) in enumerate(zip(self.groups, block_ids)):
            index = torch.as_tensor(list(ids), dtype=torch.int64)
            for layer in group.layers:
                pages = self.caches[layer].index_select(0, index)
                arrays[f"{g}:{layer}"] = pages.reshape(len(ids), -1).view(torch.uint8).numpy()
        tmp = self.dir / f".{kind}-{request_id}{self.suffix}.npz"
        np.savez(tmp, **arrays)
        tmp.rename(self.dir / f"{kind}-{request_id}{self.suffix}.npz")
