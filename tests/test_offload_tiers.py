"""Lower offload tiers: local disk and Mooncake Store below the host pool, with per-page integrity.

Pages cross process boundaries for real: one instance (`tests/tier_instance.py`) stores, another
process started after it exited loads and compares byte for byte. Faults are real too: bytes flipped
in a batch file and in a stored object, a file cut short, a tmpfs filled up, the master killed and
brought back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvconnect import metrics
from kvconnect.errors import KVConnectError, TransferError
from kvconnect.offload import OffloadConnector
from kvconnect.offload.tiers import PoolView
from kvconnect.offload.tiers.chain import TierChain
from kvconnect.offload.tiers.disk import SUFFIX, DiskTier
from kvconnect.offload.tiers.fileio import IOV_MAX, read_all, write_all
from kvconnect.offload.tiers import disk_load, overlap, store as store_tier, store_staging
from kvconnect.offload.tiers.calls import InFlight
from kvconnect.offload.tiers.integrity import RegionHasher, page_checksums, slot_checksums
from kvconnect.offload.tiers.local_store import LocalStore
from kvconnect.offload.tiers.store import StoreTier

from conftest import random_bytes_

INSTANCE = Path(__file__).resolve().parent / "tier_instance.py"
pytestmark = pytest.mark.timeout(300)


def instance(mode: str, tier: str, *extra: str, prefix: tuple[str, ...] = ()) -> dict:
    """Run one instance process to the end; its JSON line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([*prefix, sys.executable, str(INSTANCE), mode, "--tier", tier, *extra],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def kv(seed: int = 3, blocks: int = 32) -> dict[str, torch.Tensor]:
    return {f"l{i}": random_bytes_(torch.empty((blocks, 2, 16, 8), dtype=torch.float32), seed + i) for i in range(3)}


def connector(caches: dict[str, torch.Tensor], tiers: list, slots: int = 16) -> OffloadConnector:
    slot = sum(t[0].nbytes for t in caches.values())
    conn = OffloadConnector(cpu_bytes=slot * slots, tiers=tiers, timeout_s=30.0)
    conn.register_kv_caches(caches)
    return conn


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (random bytes as float32 hold NaNs, which torch.equal calls unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def stored(conn: OffloadConnector, tokens: np.ndarray, ids: np.ndarray) -> list[bytes]:
    keys = conn.block_keys(tokens)
    conn.wait(conn.store(keys, ids))
    assert conn.flush_tiers(30)
    return keys


def tokens(n_blocks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n_blocks * 16)


# ---- integrity ----

def test_checksum_binds_key_and_bytes():
    pages = np.random.default_rng(0).integers(0, 256, (4, 4096), dtype=np.uint8)
    keys = [bytes([i]) * 16 for i in range(4)]
    base = page_checksums(keys, pages)
    assert len(set(base.tolist())) == 4
    flipped = pages.copy()
    flipped[2, 100] ^= 1
    assert (page_checksums(keys, flipped) != base).tolist() == [False, False, True, False]
    assert (page_checksums(keys[::-1], pages) != base).all()  # same bytes under other keys


def test_checksum_of_pool_slots_equals_checksum_of_gathered_pages():
    rows = tuple(np.random.default_rng(i).integers(0, 256, (8, n), dtype=np.uint8) for i, n in enumerate((512, 96)))
    pool = PoolView(rows)
    slots = np.array([5, 0, 7])
    keys = [b"a" * 16, b"b" * 16, b"c" * 16]
    assert (slot_checksums(keys, pool, slots) == page_checksums(keys, pool.gather(slots))).all()


def test_vectored_file_io_moves_more_buffers_than_one_call_takes_and_stops_at_the_end(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * IOV_MAX * 7 + 5, dtype=np.uint8)
    views = [memoryview(data[i:i + 7]) for i in range(0, data.size, 7)]  # > IOV_MAX buffers, uneven last
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        write_all(fd, views, 4096)
        back = np.zeros(data.size + 100, dtype=np.uint8)  # asks for more than the file holds
        got = read_all(fd, [memoryview(back[i:i + 9]) for i in range(0, back.size, 9)], 4096)
    finally:
        os.close(fd)
    assert got == data.size and bytes(back[:got]) == data.tobytes()
    assert (tmp_path / "f").stat().st_size == 4096 + data.size


def test_checksums_hashed_piece_by_piece_equal_the_per_page_checksum():
    rows = tuple(np.random.default_rng(i).integers(0, 256, (9, n), dtype=np.uint8) for i, n in enumerate((512, 96, 40)))
    pool = PoolView(rows)
    slots = np.array([8, 1, 2, 3, 0, 6, 5])
    keys = [bytes([i]) * 16 for i in range(slots.size)]
    hasher = RegionHasher(keys, pool, slots)
    for region, cuts in enumerate(([0, 3, 7], [0, 1, 2, 7], [0, 7])):
        if region == 1:
            with pytest.raises(ValueError):
                hasher.add(1, 1, 2)  # a piece past the pages not yet hashed
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            hasher.add(region, lo, hi)
    assert (hasher.digests() == page_checksums(keys, pool.gather(slots))).all()


# ---- disk tier ----

def test_disk_pages_survive_a_restart_and_load_byte_exact_in_another_process(tmp_path):
    spec = f"disk:{tmp_path / 'kv'}:{64 << 20}"
    a = instance("store", spec, "--blocks", "24")
    assert a["error"] is None and a["flushed"] and a["stats"]["tier_disk_stored"] == 24
    b = instance("load", spec, "--blocks", "24")
    assert b == {**b, "hits": 24, "loaded": 24, "equal": True, "error": None}
    assert b["stats"]["tier_disk_loaded"] == 24 and b["stats"]["tier_disk_rejected"] == 0


def test_disk_page_with_a_flipped_byte_is_a_miss_never_wrong_bytes(tmp_path):
    caches = kv()
    conn = connector(caches, [DiskTier(tmp_path, 64 << 20)], slots=16)
    keys = stored(conn, tokens(8), np.arange(8))
    page = conn.slot_bytes
    conn.close()
    (batch,) = tmp_path.glob(f"*{SUFFIX}")
    raw = bytearray(batch.read_bytes())
    raw[len(raw) - 3 * page + 10] ^= 0x40  # pages end the file: a byte of page 5 of 8
    batch.write_bytes(bytes(raw))

    fresh = kv(seed=99)
    before = {k: v.clone() for k, v in fresh.items()}
    conn = connector(fresh, [DiskTier(tmp_path, 64 << 20)], slots=8)
    assert conn.lookup(keys) == 8  # the index still lists it: only a read can tell
    job = conn.load(keys, np.arange(8, 16))
    with pytest.raises(TransferError, match="could not be read from the lower tiers"):
        conn.wait(job)
    stats = conn.tier_stats()
    assert stats["tier_disk_rejected"] == 1 and stats["tier_disk_loaded"] == 7
    assert all(same_bytes(fresh[k], before[k]) for k in fresh), "a failed load wrote into the KV cache"
    assert conn.lookup(keys) < 8  # the bad page is forgotten, so the engine recomputes it
    conn.close()


@pytest.mark.parametrize("handoff", [0, 1 << 40], ids=["two-lanes", "inline"])
def test_disk_load_read_in_pieces_is_byte_exact_and_rejects_only_the_flipped_page(tmp_path, monkeypatch, handoff):
    monkeypatch.setattr(disk_load, "PIECE_BYTES", 3 * 4096)  # three pages a piece: several per region
    monkeypatch.setattr(overlap, "HANDOFF_BYTES", handoff)
    rng = np.random.default_rng(7)
    src = PoolView(tuple(rng.integers(0, 256, (10, n), dtype=np.uint8) for n in (4096, 1024)))
    keys = [bytes([i]) * 16 for i in range(10)]
    tier = DiskTier(tmp_path, 64 << 20)
    tier.attach(src)
    assert tier.put(keys, np.arange(10)).all()
    tier.close()
    (batch,) = tmp_path.glob(f"*{SUFFIX}")
    raw = bytearray(batch.read_bytes())
    raw[-1] ^= 1  # the last byte of the file: page 9's row of the last region
    batch.write_bytes(bytes(raw))

    dst = PoolView(tuple(np.zeros((12, n), dtype=np.uint8) for n in (4096, 1024)))
    tier = DiskTier(tmp_path, 64 << 20)
    tier.attach(dst)
    want = [9, 0, 1, 2, 3, 4, 6, 7, 8]  # runs of the file, a gap, slots out of order
    slots = np.array([11, 2, 3, 4, 5, 0, 1, 10, 9])
    got = tier.get([keys[i] for i in want], slots)
    assert got.tolist() == [False] + [True] * 8
    assert (dst.gather(slots[1:]) == src.gather(np.array(want[1:]))).all()
    assert tier.stats().rejected == 1
    tier.close()


def test_disk_load_of_a_whole_file_cut_short_after_start_rejects_only_the_pages_it_lost(tmp_path):
    rng = np.random.default_rng(8)
    widths = (4096, 1024)
    src = PoolView(tuple(rng.integers(0, 256, (6, n), dtype=np.uint8) for n in widths))
    keys = [bytes([i]) * 16 for i in range(6)]
    tier = DiskTier(tmp_path, 64 << 20)
    tier.attach(src)
    assert tier.put(keys, np.arange(6)).all()
    (batch,) = tmp_path.glob(f"*{SUFFIX}")
    os.truncate(batch, batch.stat().st_size - 2 * 1024 + 1)  # page 5's last row and most of page 4's
    dst = PoolView(tuple(np.zeros((6, n), dtype=np.uint8) for n in widths))
    tier._pool = dst  # the same tier: its index still lists every page
    assert tier.get(keys, np.arange(6)).tolist() == [True] * 4 + [False] * 2
    assert (dst.gather(np.arange(4)) == src.gather(np.arange(4))).all()
    tier.close()


def test_disk_file_left_with_no_page_of_its_own_is_deleted_at_start_and_after_rejects(tmp_path):
    rng = np.random.default_rng(9)
    pool = PoolView((rng.integers(0, 256, (4, 4096), dtype=np.uint8),))
    keys = [bytes([i]) * 16 for i in range(2)]
    for d in ("a", "b"):  # two directories, each with the same pages in its file 0
        tier = DiskTier(tmp_path / d, 64 << 20)
        tier.attach(pool)
        assert tier.put(keys, np.arange(2)).all()
        tier.close()
    (old,) = (tmp_path / "a").glob(f"*{SUFFIX}")
    (b_file,) = (tmp_path / "b").glob(f"*{SUFFIX}")
    newer = old.with_name(f"{1:016x}{SUFFIX}")
    b_file.rename(newer)  # a later file of directory a that holds every page of its file 0
    tier = DiskTier(tmp_path / "a", 64 << 20)
    tier.attach(pool)
    assert sorted(p.name for p in (tmp_path / "a").glob(f"*{SUFFIX}")) == [newer.name]
    assert tier.used_bytes() == newer.stat().st_size and tier.contains(keys).all()

    raw = bytearray(newer.read_bytes())
    raw[-1] ^= 1  # page 1's last byte
    raw[-4097] ^= 1  # page 0's
    newer.write_bytes(bytes(raw))
    assert tier.get(keys, np.arange(2, 4)).tolist() == [False, False]
    # Both of its pages were rejected: the file holds nothing the tier serves, so it is gone at once.
    assert not newer.exists() and tier.used_bytes() == 0
    tier.close()


def test_disk_file_cut_short_is_dropped_at_start(tmp_path):
    caches = kv()
    conn = connector(caches, [DiskTier(tmp_path, 64 << 20)], slots=8)
    keys = stored(conn, tokens(8), np.arange(8))
    conn.close()
    (batch,) = tmp_path.glob(f"*{SUFFIX}")
    os.truncate(batch, batch.stat().st_size - 100)
    (tmp_path / f"{'9' * 16}{SUFFIX}.tmp").write_bytes(b"half a batch")  # a crash mid-write
    conn = connector(kv(seed=5), [DiskTier(tmp_path, 64 << 20)], slots=8)
    assert conn.lookup(keys) == 0
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]
    conn.close()


def test_disk_budget_evicts_oldest_files(tmp_path):
    caches = kv(blocks=32)
    page = sum(t[0].nbytes for t in caches.values())
    tier = DiskTier(tmp_path, 20 * page)  # room for two batches of eight pages (plus headers), not three
    conn = connector(caches, [tier], slots=32)
    first = stored(conn, tokens(8, seed=1), np.arange(8))
    second = stored(conn, tokens(8, seed=2), np.arange(8, 16))
    third = stored(conn, tokens(8, seed=3), np.arange(16, 24))
    assert tier.used_bytes() <= 20 * page
    assert (tier.contains(first) == False).all()  # noqa: E712
    assert tier.contains(second).all() and tier.contains(third).all()
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
    conn.close()


def test_disk_directory_in_use_by_another_tier_is_refused_until_closed(tmp_path):
    first = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(KVConnectError, match="in use by another disk tier"):
        DiskTier(tmp_path, 1 << 20)
    first.close()
    DiskTier(tmp_path, 1 << 20).close()


def test_disk_unwritable_directory_is_a_clear_error_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(KVConnectError, match="not writable"):
        DiskTier(blocker / "kv", 1 << 20)


def test_disk_full_stops_storing_with_a_metric_and_the_host_tier_keeps_serving(tmp_path):
    """A 256 KiB tmpfs (in a private mount namespace) holds one batch; later stores fail and are counted."""
    path = tmp_path / "small"
    path.mkdir()
    prefix = ("unshare", "-rm") if os.geteuid() != 0 else ("unshare", "-m")
    out = instance("store", f"disk:{path}:{1 << 30}", "--blocks", "24", "--cpu-blocks", "64", "--mount-tmpfs", "256k",
                   prefix=prefix)  # 24 pages of 12 KiB in one batch: more than 256 KiB
    assert out["error"] is None and out["flushed"]  # the host store itself succeeded
    assert out["stats"]["tier_disk_store_failed"] == 24 and out["stats"]["tier_disk_stored"] == 0
    assert not list(path.iterdir())  # nothing of the failed batch left behind (and the tmpfs is gone)


def test_disk_pages_of_another_layout_are_not_read(tmp_path):
    conn = connector(kv(), [DiskTier(tmp_path, 64 << 20)], slots=8)
    keys = stored(conn, tokens(8), np.arange(8))
    conn.close()
    other = {f"l{i}": torch.zeros((32, 2, 16, 4), dtype=torch.float32) for i in range(3)}  # half the page
    conn = connector(other, [DiskTier(tmp_path, 64 << 20)], slots=8)
    assert conn.lookup(keys) == 0
    conn.close()
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1  # left alone, not deleted


# ---- chain ----

def test_prefix_load_takes_the_host_hits_then_the_blocks_below(tmp_path):
    caches = kv(blocks=48)
    want = {k: v.clone() for k, v in caches.items()}
    conn = connector(caches, [DiskTier(tmp_path, 64 << 20)], slots=16)
    toks = tokens(12)
    keys = stored(conn, toks, np.arange(12))  # pool of 16: all 12 in the host pool, 8 written down
    assert conn.tier_stats()["tier_disk_stored"] == 8  # write-behind holds at most half the pool pinned
    stored(conn, tokens(12, seed=9), np.arange(12, 24))  # evicts most of the first request from the host
    assert not conn.manager.published(keys).all()
    hits = conn.lookup(keys)
    job = conn.wait(conn.load_prefix(keys, np.arange(24, 36)))
    assert job.num_blocks == hits >= 8
    assert all(same_bytes(caches[k][24:24 + hits], want[k][:hits]) for k in caches)
    assert conn.stats().promoted > 0
    conn.close()


def test_write_behind_queue_is_bounded_and_the_tail_is_skipped(tmp_path):
    conn = connector(kv(), [DiskTier(tmp_path, 64 << 20)], slots=8)
    stored(conn, tokens(8), np.arange(8))
    stats = conn.tier_stats()
    assert stats["tier_disk_stored"] == 4 and stats["tier_write_behind_skipped"] == 4
    assert conn.manager.pinned() == 0
    conn.close()


def test_a_tier_kind_twice_is_refused(tmp_path):
    pool = PoolView((np.zeros((4, 64), dtype=np.uint8),))
    tiers = [DiskTier(tmp_path / "a", 1 << 20), DiskTier(tmp_path / "b", 1 << 20)]
    with pytest.raises(KVConnectError, match="at most once"):
        TierChain(tiers, pool)
    for tier in tiers:
        tier.close()


def test_tier_pages_metric_counts_by_tier_and_event(tmp_path):
    before = metrics.tier_pages.labels("disk", "stored")._value.get()
    conn = connector(kv(), [DiskTier(tmp_path, 64 << 20)], slots=16)
    stored(conn, tokens(4), np.arange(4))
    assert metrics.tier_pages.labels("disk", "stored")._value.get() == before + 4
    conn.close()


# ---- Mooncake Store tier ----

def test_store_instance_a_stores_instance_b_loads_byte_exact(mooncake_store):
    spec = f"store:{mooncake_store.address}"
    a = instance("store", spec, "--blocks", "24")
    assert a["error"] is None and a["stats"]["tier_store_stored"] == 24, a
    b = instance("load", spec, "--blocks", "24")  # another process, started after A exited
    assert b == {**b, "hits": 24, "loaded": 24, "equal": True, "error": None}, b
    assert b["stats"]["tier_store_loaded"] == 24


def test_store_object_with_flipped_bytes_is_a_miss(mooncake_store):
    from mooncake.store import MooncakeDistributedStore

    caches = kv()
    tier = StoreTier(mooncake_store.address)
    conn = connector(caches, [tier], slots=8)
    keys = stored(conn, tokens(4), np.arange(4))
    assert conn.tier_stats()["tier_store_stored"] == 4
    # Another client rewrites one object with one bit flipped (same length, trailer kept).
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_store.address) == 0
    name = tier._prefix + keys[2].hex()
    blob = bytearray(raw.get(name))
    assert len(blob) == conn.slot_bytes + 16
    blob[1000] ^= 1
    assert raw.upsert(name, bytes(blob)) == 0
    raw.close()

    fresh = kv(seed=50)
    other = connector(fresh, [StoreTier(mooncake_store.address)], slots=8)
    assert other.lookup(keys) == 4
    with pytest.raises(TransferError, match="could not be read"):
        other.wait(other.load(keys, np.arange(4)))
    assert other.tier_stats()["tier_store_rejected"] == 1
    job = other.wait(other.load_prefix(keys[:2], np.arange(10, 12)))  # the good ones still load
    assert job.num_blocks == 2 and all(same_bytes(fresh[k][10:12], caches[k][:2]) for k in fresh)
    other.close()
    conn.close()


def test_store_master_down_at_start_leaves_the_host_tier_serving_then_connects(tmp_path, caplog):
    cluster = LocalStore(tmp_path)  # not started yet
    caches = kv()
    tier = StoreTier(cluster.address, retry_s=0.5)
    start = time.monotonic()
    conn = connector(caches, [tier], slots=16)
    assert time.monotonic() - start < 10  # the engine does not wait for the store
    assert not tier.available and "unreachable" in caplog.text
    keys = stored(conn, tokens(4), np.arange(4))
    assert conn.lookup(keys) == 4  # the host pool serves
    assert conn.tier_stats()["tier_store_store_failed"] == 4
    try:
        cluster.start()
        assert tier.wait_available(30), "the tier did not connect once the master was up"
        later = stored(conn, tokens(4, seed=1), np.arange(4, 8))
        assert tier.contains(later).all() and conn.tier_stats()["tier_store_stored"] == 4
    finally:
        conn.close()
        cluster.stop()


def test_store_master_killed_mid_run_fails_loads_in_time_then_reconnects(mooncake_store):
    caches = kv(blocks=48)
    want = {k: v.clone() for k, v in caches.items()}
    tier = StoreTier(mooncake_store.address)
    conn = connector(caches, [tier], slots=8)
    keys = stored(conn, tokens(4), np.arange(4))
    assert conn.tier_stats()["tier_store_stored"] == 4

    fresh = kv(seed=70, blocks=48)
    reader = connector(fresh, [StoreTier(mooncake_store.address, retry_s=1.0)], slots=8)
    assert reader.lookup(keys) == 4
    mooncake_store.kill_master()
    start = time.monotonic()
    assert reader.lookup(keys) == 0  # an unreachable master lists nothing: the engine computes
    job = reader.load_prefix(keys, np.arange(4))
    reader.wait(job)
    assert job.num_blocks == 0
    stored(conn, tokens(4, seed=2), np.arange(4, 8))  # dropped below, kept in the host pool
    assert time.monotonic() - start < 30
    assert conn.tier_stats()["tier_store_store_failed"] >= 4

    # A new master knows no objects (the master keeps their metadata in memory); what is stored
    # once the storage node and the clients found it again is served as before.
    mooncake_store.start_master()
    deadline = time.monotonic() + 60
    later = stored(conn, tokens(4, seed=3), np.arange(8, 12))
    seed = 10
    while not tier.contains(later).all() and time.monotonic() < deadline:
        time.sleep(1.0)
        seed += 1
        later = stored(conn, tokens(4, seed=seed), np.arange(8, 12))
    time.sleep(1.5)  # the reader stopped asking the master for retry_s after the failed lookup
    got = reader.wait(reader.load_prefix(later, np.arange(20, 24)))
    assert got.num_blocks == 4 and all(same_bytes(fresh[k][20:24], want[k][8:12]) for k in fresh)
    reader.close()
    conn.close()


def test_store_master_stalled_bounds_lookups_and_loads_then_serves_again(mooncake_store):
    """SIGSTOP the master: Mooncake's RPCs would wait out their 30 s timeout; lookups must not."""
    caches = kv(blocks=48)
    conn = connector(caches, [StoreTier(mooncake_store.address)], slots=8)
    keys = stored(conn, tokens(4), np.arange(4))
    fresh = kv(seed=80, blocks=48)
    reader = connector(fresh, [StoreTier(mooncake_store.address, retry_s=2.0)], slots=8)
    assert reader.lookup(keys) == 4
    os.kill(mooncake_store.master.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert reader.lookup(keys) == 0  # the RPC is abandoned after SLOW_LOOKUP_S
        assert reader.lookup(keys) == 0  # and not asked again while the master is presumed down
        job = reader.wait(reader.load_prefix(keys, np.arange(4)))
        assert job.num_blocks == 0
        assert time.monotonic() - start < 10, "a stalled master held the lookups"
    finally:
        os.kill(mooncake_store.master.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while reader.lookup(keys) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    got = reader.wait(reader.load_prefix(keys, np.arange(10, 14)))
    assert got.num_blocks == 4 and all(same_bytes(fresh[k][10:14], caches[k][:4]) for k in fresh)
    assert reader.manager.pinned() == 0 and reader.stats().in_flight == 0  # nothing left held
    reader.close()
    conn.close()


def test_store_batches_and_staging_are_sized_by_pages_their_trailers_aside(monkeypatch):
    pool = PoolView((np.zeros((1, 4096), dtype=np.uint8), np.zeros((1, 4096), dtype=np.uint8)))
    monkeypatch.setattr(store_tier, "MAX_BATCH_BYTES", 4 * pool.page_bytes)
    monkeypatch.setattr(store_staging, "GET_STAGING_BYTES", 8 * pool.page_bytes)
    tier = StoreTier("127.0.0.1:1")
    tier._pool = pool
    assert [(b.start, b.stop) for b in tier._batches(10)] == [(0, 4), (4, 8), (8, 10)]
    staging = store_staging.StagingArea(pool, 128, InFlight(), lambda n: None)
    assert staging.capacity == 4 and staging.rows.shape == (8, pool.page_bytes + store_staging.TRAILER_BYTES)


def test_store_put_of_several_batches_seals_each_one_and_loads_byte_exact(mooncake_store, monkeypatch):
    monkeypatch.setattr(store_tier, "MAX_BATCH_KEYS", 3)  # four batches, each sealed while the last is put
    rng = np.random.default_rng(11)
    widths = (256 << 10, 320 << 10)  # long rows: put straight from the pool with a trailer each
    src = PoolView(tuple(rng.integers(0, 256, (10, n), dtype=np.uint8) for n in widths))
    keys = [bytes([i]) * 16 for i in range(10)]
    writer = StoreTier(mooncake_store.address)
    writer.attach(src)
    assert writer._gather is None and writer.wait_available(30)
    assert writer.put(keys, np.arange(10)).all()
    dst = PoolView(tuple(np.zeros((10, n), dtype=np.uint8) for n in widths))
    reader = StoreTier(mooncake_store.address)
    reader.attach(dst)
    assert reader.wait_available(30)
    assert reader.get(keys, np.arange(10)[::-1].copy()).all()
    assert (dst.gather(np.arange(10)[::-1].copy()) == src.gather(np.arange(10))).all()
    reader.close()
    writer.close()
