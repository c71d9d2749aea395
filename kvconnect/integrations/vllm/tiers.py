"""The lower tiers of KVConnectOffload: built from the extra config, split between scheduler and worker.

The worker owns the bytes: a `TierChain` of the configured tiers over its host pool (write-behind of
stored blocks, fetches of promoted ones). The scheduler decides what to load, so it needs to know what
lies below without touching bytes: `LowerIndex` asks the store's master directly (another instance may
have stored a page) and keeps the disk's keys as a set, read from the directory at start and kept in
step by the worker's reports (pages written, evicted, or found missing or corrupt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from kvconnect.integrations.vllm.config import DiskTierConfig, StoreTierConfig, TierConfig
from kvconnect.offload.tiers import Tier
from kvconnect.offload.tiers.disk import DiskTier
from kvconnect.offload.tiers.store import StoreTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def tier_namespace(vllm_config: VllmConfig, salt: str) -> bytes:
    """What the pages are: model, dtype, block size and salt (keys already hold the tokens and salt)."""
    model = vllm_config.model_config
    return f"vllm|{model.model}|{model.dtype}|{vllm_config.cache_config.block_size}|{salt}".encode()


def make_tiers(configs: Sequence[TierConfig], namespace: bytes) -> list[Tier]:
    """The worker's tiers, in configured order (the first that has a page serves it)."""
    tiers: list[Tier] = []
    for cfg in configs:
        if isinstance(cfg, DiskTierConfig):
            tiers.append(DiskTier(cfg.path, int(cfg.max_gib * (1 << 30)), namespace=namespace, journal=True))
        else:
            tiers.append(_store(cfg, namespace))
    return tiers


def _store(cfg: StoreTierConfig, namespace: bytes) -> StoreTier:
    return StoreTier(cfg.master, protocol=cfg.protocol, local_host=cfg.local_host, device=cfg.device,
                     namespace=namespace, retry_s=cfg.retry_s, get_timeout_s=cfg.get_timeout_s)


class LowerIndex:
    """The scheduler's view of the lower tiers: which keys some tier holds."""

    def __init__(self, configs: Sequence[TierConfig], namespace: bytes, page_bytes: int):
        self._disk: set[bytes] | None = None
        self._store: StoreTier | None = None
        for cfg in configs:
            if isinstance(cfg, DiskTierConfig):
                self._disk = DiskTier.scan(cfg.path, namespace, page_bytes)
            else:
                self._store = _store(cfg, namespace)
                self._store.open_for_lookups(page_bytes)

    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        """True per key some lower tier holds (a load still verifies every page)."""
        found = np.zeros(len(keys), dtype=bool)
        if self._disk is not None:
            found[:] = [k in self._disk for k in keys]
        if self._store is not None and not found.all():
            todo = np.flatnonzero(~found)
            found[todo] = self._store.contains([keys[i] for i in todo])
        return found

    def update(self, stored: Iterable[bytes], gone: Iterable[bytes]) -> None:
        """The worker's report: disk pages written, and pages no longer there (evicted, missing, corrupt)."""
        if self._disk is not None:
            self._disk.update(stored)
            self._disk.difference_update(gone)

    def disk_keys(self) -> int:
        """Pages the disk tier holds, as far as this scheduler knows."""
        return 0 if self._disk is None else len(self._disk)

    def close(self) -> None:
        """Close the store client."""
        if self._store is not None:
            self._store.close()
