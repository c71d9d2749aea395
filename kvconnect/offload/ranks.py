"""Lower tiers shared by the tensor-parallel ranks of one engine: where each rank writes, and what all hold.

Each rank holds its own shard of every block and writes it below under its own keys (`shard_keys`
of its `shard_id`): in a Mooncake Store the keys keep the shards apart, on disk each rank also has
its own directory (`rank_path`), since a disk tier has one writer per directory. One scheduler decides
for every rank, so `RankIndex` counts a block as held below only when every rank's page is held: a
load it plans never leaves one rank without its heads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from kvconnect.offload.keys import shard_keys
from kvconnect.offload.tiers.disk import DiskTier
from kvconnect.offload.tiers.store import StoreTier


def rank_path(path: str | os.PathLike, tp: int, rank: int) -> Path:
    """The disk directory of one TP rank: `path` itself at TP 1, else `path/tp{tp}-rank{rank}`."""
    return Path(path) if tp == 1 else Path(path) / f"tp{tp}-rank{rank}"


class RankIndex:
    """A scheduler's view of the lower tiers: which blocks some tier holds for every rank.

    `shards` holds each rank's shard id (`[b""]` at TP 1). The disk's keys are read from every rank's
    directory at start and kept as one set (the ranks' keys differ), then kept in step by `update`;
    the store is asked directly (another instance may have stored a page).
    """

    def __init__(self, shards: Sequence[bytes], *, namespace: bytes, page_bytes: int,
                 disk_path: str | os.PathLike | None = None, store: StoreTier | None = None):
        self._shards = list(shards)
        tp = len(self._shards)
        self._disk: set[bytes] | None = None
        if disk_path is not None:
            self._disk = set().union(*(DiskTier.scan(rank_path(disk_path, tp, r), namespace, page_bytes)
                                       for r in range(tp)))
        self._store = store

    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        """True per block whose page some lower tier holds for every rank (a load still verifies every page)."""
        found = np.ones(len(keys), dtype=bool)
        for shard in self._shards:
            todo = np.flatnonzero(found)
            if not todo.size:
                break
            found[todo] = self._rank_contains(shard_keys([keys[i] for i in todo], shard))
        return found

    def _rank_contains(self, keys: Sequence[bytes]) -> np.ndarray:
        """True per (one rank's) key that some lower tier holds."""
        found = np.zeros(len(keys), dtype=bool)
        if self._disk is not None:
            found[:] = [k in self._disk for k in keys]
        if self._store is not None and not found.all():
            todo = np.flatnonzero(~found)
            found[todo] = self._store.contains([keys[i] for i in todo])
        return found

    def update(self, stored: Iterable[bytes], gone: Iterable[bytes]) -> None:
        """The workers' reports (any rank's keys): disk pages written, and pages no longer there."""
        if self._disk is not None:
            self._disk.update(stored)
            self._disk.difference_update(gone)

    def disk_keys(self) -> int:
        """Pages the disk tier holds, every rank's counted, as far as this scheduler knows."""
        return 0 if self._disk is None else len(self._disk)

    def close(self) -> None:
        """Close the store client."""
        if self._store is not None:
            self._store.close()
