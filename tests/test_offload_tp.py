"""KVConnectOffload under tensor parallelism, on real tiers: each rank is served its own shard only.

A TP-2 engine is two ranks, each with its own host pool at the same slots (one scheduler decides for
both) holding its own heads of every block. Here each rank is a real tier chain over its own pool,
filled with bytes of its own, writing down under its shard's keys as the vLLM worker does; the
scheduler's `RankIndex` answers for both ranks at once. Everything below reads real files and a real
Mooncake Store (the `where` fixture, tests/conftest.py), and compares bytes.
"""

from __future__ import annotations

import numpy as np

from kvconnect.offload.keys import block_keys, shard_id, shard_keys
from kvconnect.offload.ranks import RankIndex, rank_path
from kvconnect.offload.tiers import PoolView
from kvconnect.offload.tiers.chain import TierChain
from kvconnect.offload.tiers.disk import DiskTier
from kvconnect.offload.tiers.store import StoreTier
from kvconnect.shards import attention

SLOTS, PAGE, TOKENS = 8, 4096, 16
NAMESPACE = b"vllm|tiny|float32|16|"
# Four KV heads over two ranks, heads outermost: each rank's page holds two heads of 16 tokens.
PAGES = {f"model.layers.{i}.attn": attention(TOKENS, 2, PAGE // (2 * TOKENS * 2), 4, heads_outer=True)
         for i in range(2)}
TP2 = [shard_id(2, r, PAGES) for r in range(2)]


def make_tier(where: tuple[str, str], tp: int, rank: int):
    """One rank's tier, as the vLLM worker builds it: a disk directory of its own, or the shared store."""
    kind, arg = where
    if kind == "disk":
        return DiskTier(rank_path(arg, tp, rank), 8 << 20, namespace=NAMESPACE, journal=True)
    return StoreTier(arg, namespace=NAMESPACE)


def index(where: tuple[str, str], shards=(b"",)) -> RankIndex:
    """The scheduler's index of what lies below, for the ranks of `shards`."""
    kind, arg = where
    if kind == "disk":
        return RankIndex(shards, namespace=NAMESPACE, page_bytes=PAGE, disk_path=arg)
    store = StoreTier(arg, namespace=NAMESPACE)
    store.open_for_lookups(PAGE)
    return RankIndex(shards, namespace=NAMESPACE, page_bytes=PAGE, store=store)


class Rank:
    """One rank's host pool (each layer a region) and its tier chain, as the vLLM worker builds them."""

    def __init__(self, where: tuple[str, str], rank: int, tp: int = 2, seed: int | None = None):
        gen = np.random.default_rng(seed)
        self.rows = tuple(gen.integers(0, 256, (SLOTS, PAGE // 2), dtype=np.uint8) if seed is not None
                          else np.zeros((SLOTS, PAGE // 2), dtype=np.uint8) for _ in range(2))
        self.shard = TP2[rank] if tp == 2 else b""
        self.chain = TierChain([make_tier(where, tp, rank)], PoolView(self.rows))

    def write_down(self, keys: list[bytes], slots: np.ndarray) -> None:
        assert self.chain.write_behind(shard_keys(keys, self.shard), slots, lambda _k: None) == len(keys)
        assert self.chain.flush(30)

    def fetch(self, keys: list[bytes], slots: np.ndarray, shard: bytes | None = None) -> np.ndarray:
        return self.chain.fetch(shard_keys(keys, self.shard if shard is None else shard), slots)

    def pages(self, slots: np.ndarray) -> np.ndarray:
        return PoolView(self.rows).gather(slots)

    def close(self) -> None:
        self.chain.close(30)


def keys_of(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(np.random.default_rng(seed).integers(0, 30000, n * TOKENS), TOKENS)


def written_by_both_ranks(where: tuple[str, str], seed: int) -> tuple[list[bytes], np.ndarray, list[np.ndarray]]:
    """Both ranks of a TP-2 engine write four blocks below and close: (keys, slots, each rank's pages)."""
    keys, slots = keys_of(4, seed=seed), np.arange(4)
    ranks = [Rank(where, r, seed=10 * seed + r) for r in range(2)]
    written = [r.pages(slots) for r in ranks]
    for r in ranks:
        r.write_down(keys, slots)
        r.close()
    return keys, slots, written


def test_shard_ids_differ_per_rank_tp_size_and_split_and_are_empty_at_tp1():
    assert shard_id(1, 0, PAGES) == b""
    assert len(set(TP2)) == 2 and all(TP2)
    assert shard_id(4, 0, PAGES) not in TP2
    other = {k: attention(TOKENS, 2, PAGE // (2 * TOKENS * 2), 8, heads_outer=True) for k in PAGES}
    assert shard_id(2, 0, other) != TP2[0]  # another head count: another shard
    assert shard_id(2, 0, dict(reversed(PAGES.items()))) == TP2[0]  # the order layers are listed in is not
    keys = keys_of(3)
    assert shard_keys(keys, b"") == keys
    assert set(shard_keys(keys, TP2[0])).isdisjoint(shard_keys(keys, TP2[1])) and len(set(shard_keys(keys, TP2[0]))) == 3


def test_each_rank_is_served_its_own_shard_after_a_restart_and_never_another_ranks(where):
    keys, slots, written = written_by_both_ranks(where, seed=1)
    assert not np.array_equal(written[0], written[1])
    # A restart on the same directory (a new store client): fresh, zeroed pools.
    ranks = [Rank(where, r) for r in range(2)]
    try:
        for r, rank in enumerate(ranks):
            if where[0] == "disk":  # the other rank's pages are not even in this rank's directory
                assert not rank.fetch(keys, slots + 4, shard=TP2[1 - r]).any() and not rank.pages(slots + 4).any()
            assert rank.fetch(keys, slots).all()  # the same blocks' keys: this rank's own heads come up
            assert np.array_equal(rank.pages(slots), written[r])
    finally:
        for rank in ranks:
            rank.close()


def test_a_block_is_held_below_only_where_every_rank_wrote_it(where):
    keys, slots = keys_of(4, seed=2), np.arange(4)
    ranks = [Rank(where, r, seed=20 + r) for r in range(2)]
    ranks[0].write_down(keys, slots)
    ranks[1].write_down(keys[:2], slots[:2])  # rank 1 has only the first two blocks below
    for rank in ranks:
        rank.close()
    tp2, tp1 = index(where, TP2), index(where)
    try:
        assert tp2.contains(keys).tolist() == [True, True, False, False]
        assert not tp1.contains(keys).any()  # a TP-1 engine never takes a TP-2 shard for a whole page
    finally:
        tp2.close()
        tp1.close()


def test_a_tp1_engine_on_the_same_disk_directory_neither_reads_nor_evicts_tp2_shards(tmp_path):
    where = ("disk", str(tmp_path / "kv-disk"))
    keys, slots, written = written_by_both_ranks(where, seed=3)
    solo = Rank(where, 0, tp=1)
    try:
        assert not solo.fetch(keys, slots).any()
        solo.write_down(keys, slots)  # its own whole pages, in the parent directory
    finally:
        solo.close()
    assert rank_path(where[1], 1, 0) == tmp_path / "kv-disk"
    assert sorted(p.name for p in (tmp_path / "kv-disk").iterdir() if p.is_dir()) == ["tp2-rank0", "tp2-rank1"]
    for r in range(2):
        rank = Rank(where, r)
        try:
            assert rank.fetch(keys, slots).all() and np.array_equal(rank.pages(slots), written[r])
        finally:
            rank.close()
