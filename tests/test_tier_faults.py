"""Faults below the host pool never hand back wrong or unreadable bytes, and never stop a start.

A tier that raises during a fetch is a miss and the next tier serves; every single-bit flip in a disk
batch file's header and key table leaves the file unserved (and the tier starting); a Mooncake Store
object that fails its checks is rejected and removed, so lookups stop counting it; a master or a
storage node that stalls or dies after a lookup said yes ends the get within its bound, all missed,
and the abandoned call never writes a slot after another page was given it (staged gets never write
the pool; gets into the slots hold them until the call returns). Real files and a real `mooncake_master`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch

from kvconnect.errors import KVConnectError, TransferError
from kvconnect.offload import OffloadConnector
from kvconnect.offload.tiers import PoolView, Tier
from kvconnect.offload.tiers.batchfile import HEADER
from kvconnect.offload.tiers.chain import TierChain
from kvconnect.offload.tiers.disk import SUFFIX, DiskTier
from kvconnect.offload.tiers.store import TRAILER_BYTES, StoreTier

pytestmark = pytest.mark.timeout(300)
KEY_BYTES = 16


def pool(slots: int = 8, widths: Sequence[int] = (256, 128), seed: int | None = None) -> PoolView:
    """A host pool of `slots` pages, random bytes from `seed` (zeros without)."""
    rng = np.random.default_rng(seed)
    return PoolView(tuple(rng.integers(0, 256, (slots, w), dtype=np.uint8) if seed is not None
                          else np.zeros((slots, w), dtype=np.uint8) for w in widths))


def keys_of(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, KEY_BYTES, dtype=np.uint8).tobytes() for _ in range(n)]


def pages(view: PoolView, slots: Sequence[int]) -> np.ndarray:
    return view.gather(np.asarray(slots))


class RaisingTier(Tier):
    """A tier that claims every page and, on a get, scribbles over the slots and raises."""

    name = "raising"

    def attach(self, pool: PoolView) -> None:
        self.pool = pool

    def put(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        return np.ones(len(keys), dtype=bool)

    def get(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        for rows in self.pool.rows:
            rows[np.asarray(slots)] = 0xEE
        raise OSError(5, "Input/output error (a failing device)")

    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        return np.ones(len(keys), dtype=bool)


# ---- the chain ----

def test_fetch_counts_a_raising_tier_as_missed_and_takes_the_pages_from_the_next_tier(tmp_path, caplog):
    view = pool(8, seed=1)
    want = pages(view, range(4))
    disk = DiskTier(tmp_path, 1 << 20)
    raising = RaisingTier()
    chain = TierChain([raising, disk], view)
    keys = keys_of(4)
    assert disk.put(keys[:3], np.arange(3)).all()  # the disk holds three of the four
    with caplog.at_level(logging.WARNING, logger="kvconnect.offload.tiers"):
        got = chain.fetch(keys, np.arange(4, 8))
    assert got.tolist() == [True, True, True, False]  # exactly what some tier read and verified
    assert (pages(view, range(4, 7)) == want[:3]).all()
    assert "raising" in caplog.text and "Input/output error" in caplog.text
    stats = chain.stats()
    assert stats["tier_fetch_errors"] == 1 and stats["tier_raising_missed"] == 4
    assert stats["tier_disk_loaded"] == 3 and stats["tier_disk_missed"] == 1
    chain.close(5)


def test_fetch_from_a_chain_whose_only_tier_raises_reads_nothing_and_raises_nothing():
    view = pool(4, seed=2)
    chain = TierChain([RaisingTier()], view)
    assert not chain.fetch(keys_of(4), np.arange(4)).any()
    assert chain.contains(keys_of(4)).all()
    chain.close(5)


def test_a_load_through_a_raising_tier_fails_as_a_transfer_error_and_leaves_the_cache_alone():
    caches = {f"l{i}": torch.full((8, 2, 16, 8), float(i)) for i in range(2)}
    before = {k: v.clone() for k, v in caches.items()}
    conn = OffloadConnector(cpu_bytes=sum(t[0].nbytes for t in caches.values()) * 8, tiers=[RaisingTier()],
                            timeout_s=30.0)
    conn.register_kv_caches(caches)
    keys = conn.block_keys(np.arange(4 * 16))
    assert conn.lookup(keys) == 4
    with pytest.raises(TransferError, match="could not be read from the lower tiers"):
        conn.wait(conn.load(keys, np.arange(4)))
    assert all(torch.equal(caches[k], before[k]) for k in caches)
    conn.close()


# ---- disk batch files ----

def _one_batch_file(path: Path, view: PoolView, keys: list[bytes]) -> bytes:
    tier = DiskTier(path, 1 << 20)
    tier.attach(view)
    assert tier.put(keys, np.arange(len(keys))).all()
    tier.close()
    (file,) = path.glob(f"*{SUFFIX}")
    return file.read_bytes()


def test_every_single_bit_flip_in_a_batch_file_header_or_table_is_skipped_at_start_never_served(tmp_path):
    view = pool(8, seed=3)
    keys = keys_of(4, seed=3)
    raw = _one_batch_file(tmp_path / "src", view, keys)
    (name,) = [p.name for p in (tmp_path / "src").glob(f"*{SUFFIX}")]
    covered = HEADER.size + len(keys) * (KEY_BYTES + 8)
    where = tmp_path / "flip"
    target = pool(8)
    deleted = kept = 0
    for bit in range(covered * 8):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        where.mkdir()
        (where / name).write_bytes(bytes(flipped))
        tier = DiskTier(where, 1 << 20)
        tier.attach(target)  # what register_kv_caches does: must never raise
        for rows in target.rows:
            rows[:] = 0
        got = tier.get(keys, np.arange(4, 8))
        tier.close()
        assert not got.any(), f"bit {bit}: served {got.tolist()} from a file with a flipped header or table"
        left = (where / name).exists()
        deleted, kept = deleted + (not left), kept + left
        shutil.rmtree(where)
    # Only a flip in the magic makes a file look foreign (left alone); every other one deletes it.
    assert kept == 8 * 8 and deleted == covered * 8 - kept


def test_a_page_count_with_bit_56_set_does_not_stop_register_kv_caches(tmp_path):
    caches = {f"l{i}": torch.rand((8, 2, 16, 8)) for i in range(2)}
    slot = sum(t[0].nbytes for t in caches.values())
    conn = OffloadConnector(cpu_bytes=slot * 8, tiers=[DiskTier(tmp_path, 64 << 20)], timeout_s=30.0)
    conn.register_kv_caches(caches)
    keys = conn.block_keys(np.arange(4 * 16))
    conn.wait(conn.store(keys, np.arange(4)))
    assert conn.flush_tiers(30) and conn.tier_stats()["tier_disk_stored"] == 4
    conn.close()
    (file,) = tmp_path.glob(f"*{SUFFIX}")
    raw = bytearray(file.read_bytes())
    raw[8 + 16 + 8 + 7] ^= 1  # the page count's top byte: bit 56
    file.write_bytes(bytes(raw))
    conn = OffloadConnector(cpu_bytes=slot * 8, tiers=[DiskTier(tmp_path, 64 << 20)], timeout_s=30.0)
    conn.register_kv_caches({k: torch.zeros_like(v) for k, v in caches.items()})
    assert conn.lookup(keys) == 0 and not file.exists()
    conn.close()



def test_a_disk_tier_on_a_full_disk_starts_and_serves_what_it_holds(tmp_path, monkeypatch, caplog):
    caches = {f"l{i}": torch.rand((8, 2, 16, 8)) for i in range(2)}
    slot = sum(t[0].nbytes for t in caches.values())
    conn = OffloadConnector(cpu_bytes=slot * 8, tiers=[DiskTier(tmp_path, 64 << 20)], timeout_s=30.0)
    conn.register_kv_caches(caches)
    keys = conn.block_keys(np.arange(4 * 16))
    conn.wait(conn.store(keys, np.arange(4)))
    assert conn.flush_tiers(30)
    conn.close()
    write_bytes = Path.write_bytes

    def full(path: Path, data: bytes) -> int:
        if path.name.startswith(".probe-"):
            raise OSError(28, "No space left on device")  # what a restart on a full cache disk meets
        return write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    with caplog.at_level(logging.WARNING, logger="kvconnect"):
        tier = DiskTier(tmp_path, 64 << 20)
    assert any("disk is full" in r.getMessage() for r in caplog.records)
    conn = OffloadConnector(cpu_bytes=slot * 8, tiers=[tier], timeout_s=30.0)
    restored = {k: torch.zeros_like(v) for k, v in caches.items()}
    conn.register_kv_caches(restored)
    assert conn.lookup(keys) == 4  # what the disk held before it filled up is served
    conn.close()


def test_a_disk_tier_directory_that_cannot_be_written_still_fails_at_start(tmp_path, monkeypatch):
    def denied(path: Path, data: bytes) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_bytes", denied)
    with pytest.raises(KVConnectError, match="not writable"):
        DiskTier(tmp_path, 64 << 20)


# ---- Mooncake Store ----

def _raw_client(address: str):
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
    return raw


SHORT_ROWS = (16384, 8192)  # one buffer per object
LONG_ROWS = (256 << 10, 320 << 10)  # a buffer per row and one for the trailer


def _stored(address: str, keys: list[bytes], seed: int = 4,
            widths: tuple[int, ...] = SHORT_ROWS) -> tuple[StoreTier, PoolView]:
    view = pool(8, widths=widths, seed=seed)
    writer = StoreTier(address)
    writer.attach(view)
    assert writer.wait_available(30) and writer.put(keys, np.arange(len(keys))).all()
    return writer, view


def _reader(address: str, widths: tuple[int, ...] = SHORT_ROWS, **kw: float) -> tuple[StoreTier, PoolView]:
    view = pool(8, widths=widths)
    reader = StoreTier(address, **kw)
    reader.attach(view)
    assert reader.wait_available(30)
    return reader, view


@pytest.mark.parametrize("widths", [SHORT_ROWS, LONG_ROWS], ids=["one-buffer", "buffer-per-row"])
@pytest.mark.parametrize("tamper", ["flipped", "short"])
def test_store_object_that_fails_its_checks_is_rejected_and_removed_so_lookups_stop_counting_it(
        mooncake_store, tamper, widths):
    keys = keys_of(4, seed=5)
    writer, src = _stored(mooncake_store.address, keys, widths=widths)
    name = writer._prefix + keys[2].hex()
    raw = _raw_client(mooncake_store.address)
    blob = bytearray(raw.get(name))
    assert len(blob) == src.page_bytes + TRAILER_BYTES
    blob[1000] ^= 1
    assert raw.upsert(name, bytes(blob) if tamper == "flipped" else bytes(blob[:100])) == 0

    reader, dst = _reader(mooncake_store.address, widths)
    assert reader._staging.direct == (widths == LONG_ROWS)
    assert reader.contains(keys).all()
    got = reader.get(keys, np.arange(4))
    assert got.tolist() == [True, True, False, True]
    assert (pages(dst, [0, 1, 3]) == pages(src, [0, 1, 3])).all()
    stats = reader.stats()
    assert stats.rejected == 1 and stats.missed == 0 and stats.loaded == 3  # a short object is rejected too
    assert reader.contains(keys).tolist() == [True, True, False, True]
    # Another instance (a scheduler asks the master directly) no longer counts it either.
    lookups = StoreTier(mooncake_store.address)
    lookups.open_for_lookups(src.page_bytes)
    assert lookups.wait_available(30) and lookups.contains(keys).tolist() == [True, True, False, True]
    assert raw.batch_is_exist([name]) == [0]
    # A page stored again under that key is served again.
    assert writer.put([keys[2]], np.array([2])).all()
    assert reader.get([keys[2]], np.array([6])).all() and (pages(dst, [6]) == pages(src, [2])).all()
    for client in (lookups, reader, writer, raw):
        client.close()


def _stall_get(reader: StoreTier, dst: PoolView, keys: list[bytes], bound: float) -> None:
    """The get after a yes from the lookup ends within `bound`, all missed; a second one at once."""
    start = time.monotonic()
    got = reader.get(keys, np.arange(4))
    took = time.monotonic() - start
    assert not got.any() and took < bound, f"get took {took:.1f} s (bound {bound} s): {got.tolist()}"
    start = time.monotonic()
    assert not reader.get(keys, np.arange(4)).any() and time.monotonic() - start < bound
    assert reader.stats().missed == 2 * len(keys) and reader.stats().loaded == 0


def _wait_stopped(pid: int) -> None:
    """Wait until every thread of `pid` is stopped (a signal reaches each thread in its own time)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [Path(t, "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()]
        if all(st in "tT" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


@pytest.mark.parametrize("who, widths", [("master", SHORT_ROWS), ("node", SHORT_ROWS), ("node", LONG_ROWS)],
                         ids=["master", "node", "node-into-slots"])
def test_store_get_ends_within_its_bound_when_the_store_stalls_after_the_lookup_and_never_writes_late(
        mooncake_store, who, widths):
    keys = keys_of(4, seed=6)
    writer, src = _stored(mooncake_store.address, keys, widths=widths)
    reader, dst = _reader(mooncake_store.address, widths, get_timeout_s=2.0, retry_s=1.0)
    assert reader._staging.direct == (widths == LONG_ROWS)
    assert reader.contains(keys).all()
    pid = (mooncake_store.master if who == "master" else mooncake_store.node).pid
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_stopped(pid)
        _stall_get(reader, dst, keys, bound=3.0)
        # Staged gets never wrote the slots; gets into the slots keep them held while the call lives.
        assert dst.quarantine.held(np.arange(4)).tolist() == [widths == LONG_ROWS] * 4
        if widths == SHORT_ROWS:
            for rows in dst.rows:
                rows[:] = 0x5A  # the pool hands these slots to other pages now
    finally:
        os.kill(pid, signal.SIGCONT)
    # Slots come free once the abandoned call returned (Mooncake's own bound); other pages go there then.
    deadline = time.monotonic() + 60
    while dst.quarantine.held(np.arange(4)).any() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not dst.quarantine.held(np.arange(4)).any()
    for rows in dst.rows:
        rows[:4] = 0x5A
    deadline = time.monotonic() + 60
    while not (got := reader.get(keys, np.arange(4, 8))).all() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert got.all() and (pages(dst, range(4, 8)) == pages(src, range(4))).all()
    assert (pages(dst, range(4)) == 0x5A).all(), "an abandoned get wrote into the pool after its slots came free"
    assert dst.quarantine.count == 0
    reader.close()
    writer.close()


def test_store_get_ends_within_its_bound_when_the_master_is_killed_after_the_lookup(mooncake_store):
    keys = keys_of(4, seed=7)
    writer, _ = _stored(mooncake_store.address, keys)
    reader, dst = _reader(mooncake_store.address, get_timeout_s=2.0, retry_s=1.0)
    assert reader.contains(keys).all()
    mooncake_store.kill_master()
    _stall_get(reader, dst, keys, bound=3.0)
    reader.close()
    writer.close()
