"""The disk tier's batch file: one file per stored batch of pages, and how it is written and read.

A batch file is a header, a table of keys and checksums, then the pages region by region (every
page's row of region 0, then of region 1, ...). The header carries a checksum of itself and one of
the table, and each page's checksum is in the table: a flipped bit anywhere reads as a corrupt file
or a corrupt page, never as a wrong page or a size to allocate. Pages are laid out so that they move
straight between the pool and the file, never through a staging copy: a store writes every region in
one vectored call (the header and table, which need the checksums, after the pages), a load reads
one call per region and run of pages. A file is written to `*.tmp` and renamed when complete, so a
crash leaves either a whole file or a leftover `.tmp`; no fsync, because what the OS had not written
when the power went fails its checksum and reads as a miss.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import xxhash

from kvconnect.errors import KVConnectError
from kvconnect.offload.mover import slot_runs
from kvconnect.offload.tiers import overlap
from kvconnect.offload.tiers.base import PoolView
from kvconnect.offload.tiers.fileio import read_all, write_all

# Version 2 covers the header and the key table by checksums; a version-1 file reads as foreign.
MAGIC = b"KVCTIER2"
# magic, namespace (16 bytes), page bytes, pages, key bytes, table checksum, header checksum
HEADER = struct.Struct("<8s16sQQQQQ")
ALIGN = 4096
SUFFIX = ".kvt"
MAX_KEY_BYTES = 1024


class CorruptBatchFile(KVConnectError):
    """A batch file of this tier whose header or table cannot be trusted (cut short, flipped, malformed)."""


def aligned(n: int) -> int:
    """`n` rounded up to the alignment of the pages in a batch file."""
    return -(-n // ALIGN) * ALIGN


def file_name(number: int) -> str:
    """The name of batch file `number` (hex, so that names sort as numbers do)."""
    return f"{number:016x}{SUFFIX}"


def file_number(path: Path) -> int:
    """The number in a batch file's name; -1 for a name that is not one."""
    try:
        return int(path.name[: -len(SUFFIX)], 16)
    except ValueError:
        return -1


@dataclass
class Table:
    """What a batch file's header and key table say, for a file that is whole."""

    keys: list[bytes]
    sums: np.ndarray
    data_offset: int
    size: int


def _digest(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def read_table(path: Path, ns: bytes, page_bytes: int) -> Table | None:
    """The file's keys and checksums; None for a file of another version, namespace or page size.

    Raises CorruptBatchFile for a file of ours that cannot be trusted. Every field is checked against
    its checksum and bounded by the file's size before anything is allocated from it.
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        raw = f.read(HEADER.size)
        if len(raw) < HEADER.size:
            if raw[:len(MAGIC)] == MAGIC[:len(raw)]:
                raise CorruptBatchFile(f"{file_size} bytes, shorter than its header")
            return None
        magic, file_ns, size, count, key_bytes, table_sum, head_sum = HEADER.unpack(raw)
        if magic != MAGIC:
            return None
        if _digest(raw[:-8]) != head_sum:
            raise CorruptBatchFile("header fails its checksum")
        if file_ns != ns or size != page_bytes:
            return None
        if count < 1 or not 1 <= key_bytes <= MAX_KEY_BYTES:
            raise CorruptBatchFile(f"header says {count} pages of {key_bytes}-byte keys")
        table_bytes = count * (key_bytes + 8)
        data_offset = data_start(count, key_bytes)
        if file_size != data_offset + count * page_bytes:
            raise CorruptBatchFile(f"{file_size} bytes where its header says {data_offset + count * page_bytes}")
        table = f.read(table_bytes)
    if len(table) != table_bytes or _digest(table) != table_sum:
        raise CorruptBatchFile("key table fails its checksum")
    rows = np.frombuffer(table, dtype=np.uint8).reshape(count, key_bytes + 8)
    return Table([rows[i, :key_bytes].tobytes() for i in range(count)],
                 rows[:, key_bytes:].copy().view("<u8").ravel(), data_offset, file_size)


def data_start(count: int, key_bytes: int) -> int:
    """Where the pages start in a batch file of `count` keys of `key_bytes` each (after header and table)."""
    return aligned(HEADER.size + count * (key_bytes + 8))


def encode_head(ns: bytes, page_bytes: int, keys: Sequence[bytes], sums: np.ndarray) -> tuple[bytes, int]:
    """(header and key table, where the pages start) of a batch file of `keys`, all of one length."""
    key_bytes = len(keys[0])
    table = np.empty((len(keys), key_bytes + 8), dtype=np.uint8)
    table[:, :key_bytes] = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, key_bytes)
    table[:, key_bytes:] = sums.astype("<u8").view(np.uint8).reshape(-1, 8)
    body = table.tobytes()
    fields = HEADER.pack(MAGIC, ns, page_bytes, len(keys), key_bytes, _digest(body), 0)[:-8]
    head = fields + struct.pack("<Q", _digest(fields)) + body
    return head, aligned(len(head))


def write_batch(path: Path, data_offset: int, pool: PoolView, slots: np.ndarray,
                checksums: Callable[[], Future], encode: Callable[[np.ndarray], bytes]) -> np.ndarray:
    """Write a batch file of the pages of `slots` under a temporary name, then rename it into place;
    the pages' checksums.

    `checksums()` starts computing them on the helper thread just before the pages are written (not
    earlier: the helper holds the GIL between its short hash calls, and the caller needs it until the
    write starts), and `encode(sums)` gives the header and table, written once the pages are.
    """
    tmp = path.with_name(path.name + ".tmp")
    pending = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # Straight from the pool, every region in one vectored write (regions follow one another
            # in the file): a buffer per run of slots and region.
            spans = slot_spans(slots)
            views = [v for rows in pool.rows for v in span_views(rows, spans)]
            pending = checksums()
            write_all(fd, views, data_offset)
            sums = overlap.result(pending)
            write_all(fd, [memoryview(encode(sums))], 0)
        finally:
            os.close(fd)
            if pending is not None:
                overlap.result(pending)  # never left reading slots that the caller may reuse
        os.rename(tmp, path)  # visible only once complete
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return sums


def read_region(fd: int, rows: np.ndarray, region_offset: int, first: int, spans: list[tuple[int, int]]) -> int:
    """Read one region's rows of pages `first`, `first + 1`, ... of a batch file into the slots of
    `spans` (the region's rows start at `region_offset`); how many arrived whole (fewer when the file
    ends early)."""
    width = rows.shape[1]
    return read_all(fd, span_views(rows, spans), region_offset + first * width) // width


def read_pages(fd: int, pool: PoolView, data_offset: int, spans: list[tuple[int, int]]) -> int:
    """Read every page of a batch file, all regions in one vectored read, into the slots of `spans`;
    how many pages arrived whole in every region (fewer when the file ends early)."""
    views = [v for rows in pool.rows for v in span_views(rows, spans)]
    got = read_all(fd, views, data_offset)
    count = whole = sum(n for _, n in spans)
    for rows in pool.rows:  # regions follow one another: a short file cuts the last ones first
        whole = min(whole, max(0, got) // rows.shape[1])
        got -= count * rows.shape[1]
    return whole


def region_offsets(pool: PoolView, data_offset: int, count: int) -> list[int]:
    """Where each region's rows start in a batch file of `count` pages (regions one after another)."""
    before = np.concatenate(([0], np.cumsum(pool.row_bytes)[:-1])).astype(np.int64)
    return (data_offset + count * before).tolist()


def slot_spans(slots: np.ndarray) -> list[tuple[int, int]]:
    """(first slot, count) per run of consecutive slots (a fresh pool hands out runs)."""
    _, first, count = slot_runs(np.asarray(slots, dtype=np.int64))
    return list(zip(first.tolist(), count.tolist()))


def span_views(rows: np.ndarray, spans: list[tuple[int, int]]) -> list[memoryview]:
    """One buffer per span of slots in `rows`."""
    return [memoryview(rows[a:a + n]).cast("B") for a, n in spans]
