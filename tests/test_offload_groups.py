"""KVConnectOffload with several KV-cache groups, on real tiers: each group is served its own pages only.

A block of tokens is one page per group (a sliding-window group and a full-attention group of the same
tokens hold different bytes), written below under that group's keys (`group_keys`), and under each
rank's shard of them with tensor parallelism, as the vLLM worker writes them. Everything below reads
real files and a real Mooncake Store (the `where` fixture, tests/conftest.py) and compares bytes:
after a restart on the same directory, between two instances sharing one store, and when a group's
page is found under another group's key.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvconnect.offload.keys import block_keys, group_keys, shard_id, shard_keys
from kvconnect.offload.ranks import rank_path
from kvconnect.offload.tiers import PoolView
from kvconnect.offload.tiers.batchfile import region_offsets
from kvconnect.offload.tiers.chain import TierChain
from kvconnect.offload.tiers.disk import DiskTier
from kvconnect.offload.tiers.store import StoreTier
from kvconnect.shards import attention

BLOCKS, GROUPS, PAGE, TOKENS = 4, 2, 4096, 16
SLOTS = BLOCKS * GROUPS
NAMESPACE = b"vllm|tiny-gemma2|float32|16|"
# Two layers of four KV heads, heads outermost: at TP 2 each rank's page holds two heads.
LAYERS = {f"model.layers.{i}.attn": attention(TOKENS, 2, PAGE // (2 * TOKENS * 2), 4, heads_outer=True)
          for i in range(2)}


def make_tier(where: tuple[str, str], tp: int, rank: int):
    """One rank's tier as the vLLM worker builds it: a disk directory of its own, or the shared store."""
    kind, arg = where
    if kind == "disk":
        return DiskTier(rank_path(arg, tp, rank), 8 << 20, namespace=NAMESPACE, journal=True)
    return StoreTier(arg, namespace=NAMESPACE)


class Worker:
    """One rank's host pool (a region per layer) and tier chain; slots `g * BLOCKS + i` hold group g's block i."""

    def __init__(self, where: tuple[str, str], tp: int = 1, rank: int = 0, seed: int | None = None):
        gen = np.random.default_rng(seed)
        self.rows = tuple(gen.integers(0, 256, (SLOTS, PAGE // 2), dtype=np.uint8) if seed is not None
                          else np.zeros((SLOTS, PAGE // 2), dtype=np.uint8) for _ in LAYERS)
        self.shard = shard_id(tp, rank, LAYERS)
        self.chain = TierChain([make_tier(where, tp, rank)], PoolView(self.rows), max_pending=SLOTS)

    def keys(self, tokens: np.ndarray) -> list[list[bytes]]:
        """Per group, the keys this rank's pages of `tokens` go under."""
        return [shard_keys(ks, self.shard) for ks in group_keys(block_keys(tokens, TOKENS), GROUPS)]

    def write_down(self, keys: list[list[bytes]]) -> None:
        flat = [k for ks in keys for k in ks]
        assert self.chain.write_behind(flat, np.arange(SLOTS), lambda _k: None) == SLOTS
        assert self.chain.flush(30)

    def fetch(self, keys: list[bytes], group: int) -> np.ndarray:
        """Fetch `keys` into group `group`'s slots (zeroed first); which pages came up."""
        slots = group * BLOCKS + np.arange(len(keys))
        for rows in self.rows:
            rows[slots] = 0
        return self.chain.fetch(keys, slots)

    def pages(self, group: int) -> np.ndarray:
        return PoolView(self.rows).gather(group * BLOCKS + np.arange(BLOCKS))

    def close(self) -> None:
        self.chain.close(30)


def tokens_of(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, BLOCKS * TOKENS)


def test_group_keys_differ_per_group_and_group_0_keeps_the_token_block_keys():
    keys = block_keys(tokens_of(0), TOKENS)
    grouped = group_keys(keys, 3)
    assert grouped[0] == keys and len(grouped) == 3
    assert len({k for ks in grouped for k in ks}) == 3 * BLOCKS
    assert group_keys(keys, 1) == [keys]
    tp2 = [shard_id(2, r, LAYERS) for r in range(2)]
    assert len({k for s in tp2 for ks in grouped for k in shard_keys(ks, s)}) == 2 * 3 * BLOCKS


@pytest.mark.parametrize("tp", [1, 2])
def test_each_group_is_served_its_own_pages_after_a_restart_and_never_another_groups(where, tp):
    tokens = tokens_of(1)
    writers = [Worker(where, tp, r, seed=10 + r) for r in range(tp)]
    written = [[w.pages(g) for g in range(GROUPS)] for w in writers]
    assert not np.array_equal(written[0][0], written[0][1])
    for w in writers:
        w.write_down(w.keys(tokens))
        w.close()
    # A restart on the same directory (a new store client): fresh, zeroed pools.
    for r in range(tp):
        w = Worker(where, tp, r)
        try:
            keys = w.keys(tokens)
            for g in range(GROUPS):
                assert w.fetch(keys[g], g).all()
                assert np.array_equal(w.pages(g), written[r][g]), f"rank {r} group {g}: another's pages"
        finally:
            w.close()


def test_two_instances_sharing_one_store_each_read_every_groups_own_pages(mooncake_store):
    where = ("store", mooncake_store.address)
    a, b = Worker(where, seed=1), Worker(where, seed=2)
    try:
        mine, theirs = tokens_of(2), tokens_of(3)
        wrote_a = [a.pages(g) for g in range(GROUPS)]
        wrote_b = [b.pages(g) for g in range(GROUPS)]
        a.write_down(a.keys(mine))
        b.write_down(b.keys(theirs))
        for reader, tokens, want in ((b, mine, wrote_a), (a, theirs, wrote_b)):
            keys = reader.keys(tokens)
            for g in range(GROUPS):
                assert reader.fetch(keys[g], g).all()
                assert np.array_equal(reader.pages(g), want[g]), f"group {g}: another group's pages"
    finally:
        a.close()
        b.close()


def _misplace_on_disk(directory: str, src: bytes, dst: bytes, rows: tuple[np.ndarray, ...]) -> None:
    """Overwrite the page of key `dst` in its batch file with the page of key `src` (a misplaced write)."""
    tier = DiskTier(directory, 8 << 20, namespace=NAMESPACE)
    tier.attach(PoolView(rows))
    try:
        (fs, ps, _), (fd, pd, _) = tier._index[src], tier._index[dst]
        files = tier._files
        offsets = [region_offsets(tier._pool, files[n].data_offset, files[n].count) for n in (fs, fd)]
        widths = [r.shape[1] for r in rows]
        with open(files[fs].path, "rb") as f:
            page = [os.pread(f.fileno(), w, off + ps * w) for off, w in zip(offsets[0], widths)]
        with open(files[fd].path, "r+b") as f:
            for part, off, w in zip(page, offsets[1], widths):
                os.pwrite(f.fileno(), part, off + pd * w)
    finally:
        tier.close()


def _misplace_in_store(address: str, src: bytes, dst: bytes) -> None:
    """Replace the object of key `dst` with the object of key `src` (a stale or misplaced object)."""
    tier = StoreTier(address, namespace=NAMESPACE)
    tier.open_for_lookups(PAGE)
    try:
        client = tier._connected()
        (src_name, dst_name) = tier._names([src, dst])
        data = client.get(src_name)
        assert len(data) > PAGE and client.remove(dst_name) == 0
        assert client.put(dst_name, data) == 0
    finally:
        tier.close()


def test_a_page_found_under_another_groups_key_fails_its_check_and_only_that_group_misses(where):
    tokens = tokens_of(4)
    w = Worker(where, seed=4)
    written = [w.pages(g) for g in range(GROUPS)]
    keys = w.keys(tokens)
    w.write_down(keys)
    w.close()
    # Group 0's page of block 1 is what group 1's key of block 1 now names.
    if where[0] == "disk":
        _misplace_on_disk(where[1], keys[0][1], keys[1][1], w.rows)
    else:
        _misplace_in_store(where[1], keys[0][1], keys[1][1])
    w = Worker(where)
    try:
        assert w.fetch(keys[1], 1).tolist() == [True, False, True, True]
        # (the failed page's slot is the caller's to free: a promotion never publishes it)
        assert np.array_equal(w.pages(1)[[0, 2, 3]], written[1][[0, 2, 3]])
        assert w.fetch(keys[0], 0).all() and np.array_equal(w.pages(0), written[0])
    finally:
        w.close()
