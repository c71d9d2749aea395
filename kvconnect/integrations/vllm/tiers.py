"""The lower tiers of KVConnectOffload: built from the extra config, split between scheduler and worker.

The worker owns the bytes: a `TierChain` of the configured tiers over its host pool (write-behind of
stored blocks, fetches of promoted ones). The scheduler decides what to load, so it needs to know what
lies below without touching bytes: `lower_index` builds a `RankIndex` that asks the store's master
directly (another instance may have stored a page) and keeps the disk's keys as a set, read from the
directory at start and kept in step by the worker's reports (pages written, evicted, or found missing
or corrupt). With tensor parallelism every rank writes its own shard under its own keys to its own
disk directory, and a block counts as held below only when every rank's page is
(`kvconnect.offload.ranks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvconnect.integrations.vllm.config import DiskTierConfig, StoreTierConfig, TierConfig
from kvconnect.offload.ranks import RankIndex, rank_path
from kvconnect.offload.tiers import Tier
from kvconnect.offload.tiers.disk import DiskTier
from kvconnect.offload.tiers.store import StoreTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def tier_namespace(vllm_config: VllmConfig, salt: str) -> bytes:
    """What the pages are: model, dtype, block size and salt (keys already hold the tokens and salt)."""
    model = vllm_config.model_config
    return f"vllm|{model.model}|{model.dtype}|{vllm_config.cache_config.block_size}|{salt}".encode()


def make_tiers(configs: Sequence[TierConfig], namespace: bytes, tp: int = 1, rank: int = 0) -> list[Tier]:
    """The worker's tiers, in configured order (the first that has a page serves it); with TP, each rank
    gets its share of the disk budget in its own directory."""
    tiers: list[Tier] = []
    for cfg in configs:
        if isinstance(cfg, DiskTierConfig):
            tiers.append(DiskTier(rank_path(cfg.path, tp, rank), int(cfg.max_gib * (1 << 30)) // tp,
                                  namespace=namespace, journal=True))
        else:
            tiers.append(_store(cfg, namespace))
    return tiers


def _store(cfg: StoreTierConfig, namespace: bytes) -> StoreTier:
    return StoreTier(cfg.master, protocol=cfg.protocol, local_host=cfg.local_host, device=cfg.device,
                     namespace=namespace, retry_s=cfg.retry_s, get_timeout_s=cfg.get_timeout_s)


def lower_index(configs: Sequence[TierConfig], namespace: bytes, page_bytes: int,
                shards: Sequence[bytes] = (b"",)) -> RankIndex:
    """The scheduler's view of the configured lower tiers, for every rank (`shards`, one per rank)."""
    disk_path, store = None, None
    for cfg in configs:
        if isinstance(cfg, DiskTierConfig):
            disk_path = cfg.path
        else:
            store = _store(cfg, namespace)
            store.open_for_lookups(page_bytes)
    return RankIndex(shards, namespace=namespace, page_bytes=page_bytes, disk_path=disk_path, store=store)
