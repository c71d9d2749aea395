"""The disk tier's load of one batch file: pages read straight into their slots and hashed as they arrive.

A batch file holds its pages region by region (`batchfile`). A load reads each region's rows of the
pages asked for in pieces of about PIECE_BYTES and hashes each piece once it is read, in two lanes:
the caller's thread and the helper (`overlap`) each read and hash half of the pages. Rows over 64 KiB
are hashed with the GIL released, so both lanes' reads and hashes run at once (measured here at 512
KiB rows: 0.91-1.03 of a plain read of the same bytes, against 0.56-0.79 in one lane). Shorter rows
hold the GIL while hashed, so the lanes take turns: one hashes while the other's read runs in the
kernel (16 KiB rows, 512-page loads: 0.62-0.65 of a plain read, against 0.50-0.60 with the caller
reading and the helper hashing behind it; at 256 pages the two were within each other's noise). A
load too small to pay for waking the helper (`overlap.HANDOFF_BYTES`) hashes its rows between the
reads, and one that takes a whole file reads it in a single vectored read.

The caller compares the checksums with the ones the file's table holds: until then the slots hold
bytes nobody has vouched for, and the engine reads none of them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvconnect.offload.mover import slot_runs
from kvconnect.offload.tiers import overlap
from kvconnect.offload.tiers.base import PoolView
from kvconnect.offload.tiers.batchfile import read_pages, read_region, region_offsets, slot_spans
from kvconnect.offload.tiers.integrity import RegionHasher

# Rows of one region read (and hashed) at a time: the hash of the last piece is all that is left
# after the last read, and the piece is still in the cache when it is hashed.
PIECE_BYTES = 2 << 20


def load_pages(fd: int, pool: PoolView, data_offset: int, count: int, in_file: np.ndarray, dst: np.ndarray,
               keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(arrived whole, checksum) per page for pages `in_file` (ascending positions in a batch file of
    `count` pages whose pages start at `data_offset`) read into slots `dst` under `keys`."""
    whole = np.ones(in_file.size, dtype=bool)
    threaded = in_file.size * int(pool.row_bytes.min()) >= overlap.HANDOFF_BYTES
    args = (fd, pool, data_offset, count, in_file, dst, keys, whole)
    if threaded and in_file.size >= 2:
        mid = in_file.size // 2
        other = overlap.later(lambda: _read_and_hash(*args, mid, in_file.size))
        try:
            first = _read_and_hash(*args, 0, mid)
        finally:
            second = overlap.result(other)  # never left reading into slots that the caller may reuse
        return whole, np.concatenate([first, second])
    if not threaded and in_file.size == count and count <= _pages_per_piece(pool):
        hasher = RegionHasher(keys, pool, dst)
        whole[read_pages(fd, pool, data_offset, slot_spans(dst)):] = False
        for region in range(len(pool.rows)):
            hasher.add(region)
        return whole, hasher.digests()
    return whole, _read_and_hash(*args, 0, in_file.size)


def _pages_per_piece(pool: PoolView) -> int:
    return max(1, PIECE_BYTES // int(pool.row_bytes.max()))


def _read_and_hash(fd: int, pool: PoolView, data_offset: int, count: int, in_file: np.ndarray, dst: np.ndarray,
                   keys: Sequence[bytes], whole: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Read pages `lo:hi` of a load region by region and piece by piece, hashing each piece after its
    read; their checksums (`whole[lo:hi]` marks those that arrived whole)."""
    # In file order, runs of consecutive pages cut into pieces: one read per region and piece, a
    # buffer per run of slots.
    sub, slots = in_file[lo:hi], dst[lo:hi]
    per = _pages_per_piece(pool)
    starts, _, lengths = slot_runs(sub)
    bounds = [a for s, n in zip(starts.tolist(), lengths.tolist()) for a in range(s, s + n, per)] + [sub.size]
    pieces = [(int(sub[a]), slot_spans(slots[a:b]), a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    hasher = RegionHasher(keys[lo:hi], pool, slots)
    for region, (rows, offset) in enumerate(zip(pool.rows, region_offsets(pool, data_offset, count))):
        for first, spans, a, b in pieces:
            whole[lo + a + read_region(fd, rows, offset, first, spans):lo + b] = False
            hasher.add(region, a, b)
    return hasher.digests()
