"""The lower tiers' fast paths keep every page checked: hashes on the helper thread, gathered and
in-place puts, gets landed a part at a time. Real files and a real `mooncake_master`; corrupt bytes
are planted in the file or the object and must read as misses, every other page byte for byte.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import numpy as np
import pytest

from kvconnect.errors import KVConnectError
from kvconnect.offload.tiers import PoolView, overlap
from kvconnect.offload.tiers.batchfile import read_table
from kvconnect.offload.tiers.disk import SUFFIX, DiskTier
from kvconnect.offload.tiers.integrity import RegionHasher, namespace_of, slot_checksums
from kvconnect.offload.tiers.store import TRAILER_BYTES, StoreTier
from kvconnect.offload.tiers.store_put import gathers

pytestmark = pytest.mark.timeout(300)
SHORT_ROWS = (16 << 10, 8 << 10)  # hashed holding the GIL (64 KiB or less); gathered into one buffer per object
LONG_ROWS = (256 << 10, 320 << 10)  # hashed with the GIL released; put straight from the pool


def pool(slots: int, widths: Sequence[int], seed: int | None = None) -> PoolView:
    rng = np.random.default_rng(seed)
    return PoolView(tuple(rng.integers(0, 256, (slots, w), dtype=np.uint8) if seed is not None
                          else np.zeros((slots, w), dtype=np.uint8) for w in widths))


def keys_of(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(n)]


def pages(view: PoolView, slots: Sequence[int]) -> np.ndarray:
    return view.gather(np.asarray(slots))


def test_checksums_built_region_by_region_equal_the_checksums_of_whole_pages():
    view = pool(6, (300, 70, 1000), seed=1)
    keys, slots = keys_of(3), np.array([4, 0, 5])
    hasher = RegionHasher(keys, view, slots)
    with pytest.raises(ValueError):
        hasher.digests()  # not every region yet
    with pytest.raises(ValueError):
        hasher.add(1)  # out of order
    for region in range(3):
        hasher.add(region)
    assert (hasher.digests() == slot_checksums(keys, view, slots)).all()


def test_the_helper_thread_hands_back_values_and_errors_and_a_late_answer_is_a_typed_error(monkeypatch):
    assert overlap.result(overlap.later(lambda: 41 + 1)) == 42
    with pytest.raises(ZeroDivisionError):
        overlap.result(overlap.later(lambda: 1 // 0))
    gate = threading.Event()
    monkeypatch.setattr(overlap, "WAIT_S", 0.05)
    try:
        with pytest.raises(KVConnectError, match="did not answer"):
            overlap.result(overlap.later(lambda: gate.wait(30)))
    finally:
        gate.set()  # the helper is shared: free it for the next job
    assert overlap.result(overlap.later(lambda: "after")) == "after"


@pytest.mark.parametrize("widths", [SHORT_ROWS, LONG_ROWS], ids=["short-rows", "long-rows"])
def test_disk_page_flipped_in_its_last_region_is_a_miss_after_a_restart_the_rest_byte_exact(tmp_path, widths):
    src = pool(4, widths, seed=2)
    keys = keys_of(4, seed=3)
    tier = DiskTier(tmp_path, 1 << 30)
    tier.attach(src)
    assert tier.put(keys, np.arange(4)).all()
    tier.close()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    table = read_table(path, namespace_of(b"", src.page_bytes), src.page_bytes)
    raw = bytearray(path.read_bytes())
    raw[table.data_offset + 4 * widths[0] + 2 * widths[1] + widths[1] - 1] ^= 0x10  # page 2, last byte
    path.write_bytes(bytes(raw))

    dst = pool(8, widths)
    again = DiskTier(tmp_path, 1 << 30)
    again.attach(dst)
    assert again.get(keys, np.array([7, 5, 3, 1])).tolist() == [True, True, False, True]
    assert (pages(dst, [7, 5, 1]) == pages(src, [0, 1, 3])).all()
    assert again.stats().rejected == 1 and again.stats().loaded == 3
    again.close()


@pytest.mark.parametrize("widths", [SHORT_ROWS, LONG_ROWS], ids=["short-rows", "long-rows"])
def test_disk_load_in_two_lanes_rejects_a_bad_page_in_either_half_and_a_cut_short_tail(tmp_path, monkeypatch, widths):
    from kvconnect.offload.tiers import disk_load, overlap

    monkeypatch.setattr(overlap, "HANDOFF_BYTES", 0)  # short rows too: any load of two pages takes two lanes

    lanes = []
    read_and_hash = disk_load._read_and_hash

    def lane(*args):
        lanes.append(args[-2:])
        return read_and_hash(*args)

    monkeypatch.setattr(disk_load, "_read_and_hash", lane)
    n = 12  # two lanes of six pages
    view = pool(3 * n, widths, seed=7)
    stored = pages(view, range(n))
    keys = keys_of(n, seed=8)
    tier = DiskTier(tmp_path, 1 << 30)
    tier.attach(view)
    assert tier.put(keys, np.arange(n)).all()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    start = read_table(path, namespace_of(b"", view.page_bytes), view.page_bytes).data_offset
    with open(path, "r+b") as f:
        for at in (start + 1 * widths[0] + 5, start + n * widths[0] + 9 * widths[1] + 7):  # page 1, page 9
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x01]))
    os.truncate(path, path.stat().st_size - 100)  # page 11's last row

    slots = np.arange(3 * n - 1, n, -2)  # past the stored pages, no two pages in consecutive slots
    got = tier.get(keys, slots)
    assert sorted(lanes) == [(0, n // 2), (n // 2, n)]  # each lane hashes what it reads
    assert got.tolist() == [i not in (1, 9, 11) for i in range(n)]
    good = np.flatnonzero(got)
    assert (pages(view, slots[good]) == stored[good]).all()
    assert tier.stats().rejected == 3 and tier.stats().loaded == n - 3
    tier.close()


def _writer(address: str, widths: Sequence[int], slots: int, keys: list[bytes]) -> tuple[StoreTier, PoolView]:
    src = pool(slots, widths, seed=4)
    writer = StoreTier(address)
    writer.attach(src)
    assert writer.wait_available(30) and writer.put(keys, np.arange(len(keys))).all()
    return writer, src


def _flip(address: str, name: str, at: int) -> None:
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
    blob = bytearray(raw.get(name))
    blob[at] ^= 1
    assert raw.upsert(name, bytes(blob)) == 0
    raw.close()


@pytest.mark.parametrize("widths", [SHORT_ROWS, LONG_ROWS], ids=["gathered", "in-place"])
def test_store_puts_gathered_or_in_place_write_the_same_object_and_a_flipped_one_is_a_miss(mooncake_store, widths):
    keys = keys_of(4, seed=5)
    writer, src = _writer(mooncake_store.address, widths, 4, keys)
    assert gathers(src) == (widths == SHORT_ROWS)
    _flip(mooncake_store.address, writer._prefix + keys[1].hex(), src.page_bytes + TRAILER_BYTES - 1)  # its checksum
    _flip(mooncake_store.address, writer._prefix + keys[2].hex(), sum(widths) - 1)  # its page's last byte

    dst = pool(8, widths)
    reader = StoreTier(mooncake_store.address)
    reader.attach(dst)
    assert reader.wait_available(30)
    assert reader.get(keys, np.array([6, 4, 2, 0])).tolist() == [True, False, False, True]
    assert (pages(dst, [6, 0]) == pages(src, [0, 3])).all()
    assert reader.stats().rejected == 2
    reader.close()
    writer.close()


def test_store_get_of_more_pages_than_a_staging_half_lands_every_part_and_rejects_only_the_bad_one(mooncake_store):
    widths, n = (512, 256), 150  # staging halves of 64 objects: three parts
    keys = keys_of(n, seed=6)
    writer, src = _writer(mooncake_store.address, widths, n, keys)
    _flip(mooncake_store.address, writer._prefix + keys[100].hex(), 7)  # in the second part

    dst = pool(2 * n, widths)
    reader = StoreTier(mooncake_store.address)
    reader.attach(dst)
    assert reader.wait_available(30) and reader._staging.capacity < n // 2
    slots = np.concatenate([np.arange(n + 50, 2 * n), np.arange(n, n + 50)])[::-1].copy()  # runs out of order
    got = reader.get(keys, slots)
    assert np.flatnonzero(~got).tolist() == [100]
    good = np.flatnonzero(got)
    assert (pages(dst, slots[good]) == pages(src, good)).all()
    reader.close()
    writer.close()


def test_a_forked_child_gets_a_helper_thread_of_its_own():
    assert overlap.result(overlap.later(lambda: 1)) == 1  # the parent's helper runs
    pid = os.fork()
    if pid == 0:  # the child: its parent's helper thread did not survive the fork
        try:
            os._exit(0 if overlap.result(overlap.later(lambda: 2)) == 2 else 1)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit status
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
