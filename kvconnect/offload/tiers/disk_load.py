"""The disk tier's load of one batch file: pages read straight into their slots and hashed as they arrive.

A batch file holds its pages region by region (`batchfile`). A load reads each region's rows of the
pages asked for in pieces of about PIECE_BYTES, and hashes each piece on the helper thread
(`overlap`) while the next piece is read, so that only the hash of the last piece is left after the
last read. A load too small to pay for waking the helper (`overlap.HANDOFF_BYTES`) hashes its rows
between the reads, and one that takes a whole file reads it in a single vectored read, as a plain
read of the file would.

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
    # In file order, runs of consecutive pages cut into pieces: one read per region and piece, a
    # buffer per run of slots.
    per = max(1, PIECE_BYTES // int(pool.row_bytes.max()))
    starts, _, lengths = slot_runs(in_file)
    bounds = [lo for a, n in zip(starts.tolist(), lengths.tolist()) for lo in range(a, a + n, per)] + [in_file.size]
    pieces = [(int(in_file[lo]), slot_spans(dst[lo:hi]), lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    whole = np.ones(in_file.size, dtype=bool)
    hasher = RegionHasher(keys, pool, dst)
    threaded = in_file.size * int(pool.row_bytes.min()) >= overlap.HANDOFF_BYTES
    if not threaded and len(pieces) == 1 and in_file.size == count:
        whole[read_pages(fd, pool, data_offset, pieces[0][1]):] = False
        for region in range(len(pool.rows)):
            hasher.add(region)
        return whole, hasher.digests()
    hashed = None
    try:
        for region, (rows, offset) in enumerate(zip(pool.rows, region_offsets(pool, data_offset, count))):
            for first, spans, lo, hi in pieces:
                whole[lo + read_region(fd, rows, offset, first, spans):hi] = False
                if threaded:
                    hashed = overlap.later(lambda r=region, a=lo, b=hi: hasher.add(r, a, b))
                else:
                    hasher.add(region, lo, hi)
    finally:
        if hashed is not None:
            overlap.result(hashed)  # the helper runs in order: the last piece done means all are
    return whole, hasher.digests()
