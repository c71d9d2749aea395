"""The local-disk tier: pages written a batch per file under one directory, with a byte budget.

A batch file is a header, a table of keys and checksums, then the pages region by region (every
page's row of region 0, then of region 1, ...), so a run of slots moves with one call per region
straight between the pool and the file, never through a staging copy. It is written to `*.tmp` and renamed when complete, so a
crash leaves either a whole file or a leftover `.tmp` that the next start deletes; no fsync, because
what the OS had not written when the power went fails its checksum and reads as a miss. At start the
tier reads every file's header and table and finds its pages again (a restarted engine keeps its
prefixes). Files of another layout or namespace (another model, salt or block size) are left alone.

Eviction is whole files, oldest first, when a new batch would pass `max_bytes`. Reads go into the
slots that a promotion allocated and not yet published, and each page's checksum is checked there:
a torn or flipped page fails the load of that promotion and its slot is freed, so it never reaches a
block the engine reads.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kvconnect.errors import KVConnectError
from kvconnect.offload.mover import slot_runs
from kvconnect.offload.tiers.base import PoolView, Tier
from kvconnect.offload.tiers.integrity import namespace_of, slot_checksums

log = logging.getLogger("kvconnect.offload.disk")

MAGIC = b"KVCTIER1"
# magic, namespace (16 bytes), page bytes, pages, key bytes
_HEADER = struct.Struct("<8s16sQQQ")
_ALIGN = 4096
SUFFIX = ".kvt"
IOV_MAX = 1024


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class _Table:
    """What a batch file's header and key table say, for a file that is whole."""

    keys: list[bytes]
    sums: np.ndarray
    data_offset: int
    size: int


_TRUNCATED = _Table([], np.empty(0, dtype=np.uint64), 0, 0)


def _read_table(path: Path, ns: bytes, page_bytes: int) -> _Table | None:
    """The file's keys and checksums; None for another namespace or page size, _TRUNCATED if cut short."""
    with open(path, "rb") as f:
        magic, file_ns, size, count, key_bytes = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC or file_ns != ns or size != page_bytes:
            return None
        raw = f.read(count * (key_bytes + 8))
        file_size = os.fstat(f.fileno()).st_size
    data_offset = _aligned(_HEADER.size + count * (key_bytes + 8))
    if len(raw) != count * (key_bytes + 8) or file_size < data_offset + count * page_bytes:
        return _TRUNCATED
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(count, key_bytes + 8)
    return _Table([rows[i, :key_bytes].tobytes() for i in range(count)],
                  rows[:, key_bytes:].copy().view("<u8").ravel(), data_offset, file_size)


@dataclass
class _File:
    path: Path
    nbytes: int
    data_offset: int
    live: int
    keys: list[bytes]

    @property
    def count(self) -> int:
        """Pages the file was written with."""
        return len(self.keys)


class DiskTier(Tier):
    """Pages under `path`, at most `max_bytes` of batch files; `namespace` keeps models and layouts apart."""

    name = "disk"

    def __init__(self, path: str | os.PathLike, max_bytes: int, namespace: bytes = b"", journal: bool = False):
        super().__init__()
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise KVConnectError(f"disk tier max_bytes must be a positive int, got {max_bytes!r}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.namespace = namespace
        self._pool: PoolView | None = None
        self._ns = b""
        self._index: dict[bytes, tuple[int, int, int]] = {}  # key -> (file id, page in file, checksum)
        self._files: OrderedDict[int, _File] = OrderedDict()  # oldest first
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()
        self._warned: set[bytes] = set()
        self._store_error: str | None = None
        self._lock_fd = -1
        # With `journal`, keys gained and lost are kept for `drain_changes` (a scheduler's index).
        self._journal = journal
        self._added: list[bytes] = []
        self._gone: list[bytes] = []
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}"
            probe.write_bytes(b"kvconnect")
            probe.unlink()
            self._lock_fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise KVConnectError(f"disk tier directory {self.path} is not writable: {exc.strerror or exc}") from exc
        try:
            # One writer per directory: two would number their files alike and evict each other's.
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise KVConnectError(f"disk tier directory {self.path} is in use by another disk tier "
                                 "(give each engine instance its own directory)") from None

    # ---- setup and restart ----

    def attach(self, pool: PoolView) -> None:
        """Bind to the pool and find the pages of earlier runs with the same namespace and page size."""
        self._pool = pool
        self._ns = namespace_of(self.namespace, pool.page_bytes)
        for leftover in self.path.glob(f"*{SUFFIX}.tmp"):
            leftover.unlink(missing_ok=True)
        found = sorted(self.path.glob(f"*{SUFFIX}"), key=lambda p: self._file_number(p))
        for path in found:
            self._adopt(path)
        self._recount()
        if self._files:
            self._next = max(self._files) + 1
            log.info("disk tier %s: found %d pages in %d files (%d bytes)", self.path, len(self._index),
                     len(self._files), self._bytes)
        self._evict(0)

    @staticmethod
    def scan(path: str | os.PathLike, namespace: bytes, page_bytes: int) -> set[bytes]:
        """Keys held by the batch files under `path` for this namespace and page size (a scheduler's index)."""
        ns = namespace_of(namespace, page_bytes)
        keys: set[bytes] = set()
        for file in sorted(Path(path).glob(f"*{SUFFIX}"), key=DiskTier._file_number):
            try:
                table = _read_table(file, ns, page_bytes)
            except (OSError, struct.error):
                continue
            if table is not None and table is not _TRUNCATED:
                keys.update(table.keys)
        return keys

    def _note(self, added: Sequence[bytes], gone: Sequence[bytes]) -> None:
        if self._journal:
            self._added.extend(added)
            self._gone.extend(gone)

    def drain_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(keys stored, keys gone: evicted or rejected) since the last call, for a scheduler's index."""
        with self._lock:
            out = (self._added, self._gone)
            self._added, self._gone = [], []
        return out

    @staticmethod
    def _file_number(path: Path) -> int:
        try:
            return int(path.name[: -len(SUFFIX)], 16)
        except ValueError:
            return -1

    def _adopt(self, path: Path) -> None:
        number = self._file_number(path)
        if number < 0:
            return
        try:
            table = _read_table(path, self._ns, self._pool.page_bytes)
        except (OSError, struct.error):
            log.warning("disk tier: skipping unreadable batch file %s", path)
            return
        if table is None:
            return  # another layout or model: not ours to read or delete
        if table is _TRUNCATED:
            log.warning("disk tier: deleting truncated batch file %s", path)
            path.unlink(missing_ok=True)
            return
        for i, key in enumerate(table.keys):
            self._index[key] = (number, i, int(table.sums[i]))
        self._files[number] = _File(path, table.size, table.data_offset, 0, table.keys)
        self._bytes += table.size

    def _recount(self) -> None:
        """Live pages per file after the index changed owners (a later file wins a key)."""
        for f in self._files.values():
            f.live = 0
        for number, _, _ in self._index.values():
            self._files[number].live += 1

    # ---- put ----

    def put(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        """Write the pages of `slots` not yet on disk to one new batch file."""
        pool = self._require()
        slots = np.asarray(slots, dtype=np.int64)
        with self._lock:
            fresh = np.array([k not in self._index for k in keys], dtype=bool)
        ok = ~fresh
        if not fresh.any():
            return ok
        new_keys = [k for k, f in zip(keys, fresh) if f]
        new_slots = slots[fresh]
        sums = slot_checksums(new_keys, pool, new_slots)
        key_bytes = len(new_keys[0])
        if any(len(k) != key_bytes for k in new_keys):
            raise KVConnectError("disk tier keys must all have one length")
        table = np.empty((len(new_keys), key_bytes + 8), dtype=np.uint8)
        table[:, :key_bytes] = np.frombuffer(b"".join(new_keys), dtype=np.uint8).reshape(-1, key_bytes)
        table[:, key_bytes:] = sums.astype("<u8").view(np.uint8).reshape(-1, 8)
        header = _HEADER.pack(MAGIC, self._ns, pool.page_bytes, len(new_keys), key_bytes)
        data_offset = _aligned(len(header) + table.nbytes)
        nbytes = len(new_keys) * pool.page_bytes
        size = data_offset + nbytes
        with self._lock:
            number = self._next
            self._next += 1
            self._evict(size)
        path = self.path / f"{number:016x}{SUFFIX}"
        try:
            self._write(path, header + table.tobytes(), data_offset, pool, new_slots)
        except OSError as exc:
            self._count("store_failed", len(new_keys))
            if self._store_error != exc.strerror:
                self._store_error = exc.strerror
                log.warning("disk tier %s: storing failed (%s); pages are dropped and counted until writes succeed",
                            self.path, exc.strerror or exc)
            return ok
        self._store_error = None
        with self._lock:
            self._files[number] = _File(path, size, data_offset, 0, new_keys)
            self._bytes += size
            for i, key in enumerate(new_keys):
                old = self._index.get(key)
                if old is not None:
                    self._files[old[0]].live -= 1
                self._index[key] = (number, i, int(sums[i]))
            self._files[number].live = len(new_keys)
            self._note(new_keys, ())
            self._drop_dead()
        self._count("stored", len(new_keys), nbytes)
        ok[fresh] = True
        return ok

    @staticmethod
    def _write(path: Path, head: bytes, data_offset: int, pool: PoolView, slots: np.ndarray) -> None:
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, [memoryview(head.ljust(data_offset, b"\0"))], 0)
                # Region by region, straight from the pool: one call per region, a buffer per run of slots.
                for rows, offset in zip(pool.rows, _region_offsets(pool, data_offset, slots.size)):
                    _write_all(fd, _run_views(rows, slots), offset)
            finally:
                os.close(fd)
            os.rename(tmp, path)  # visible only once complete
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _evict(self, incoming: int) -> None:
        """Delete the oldest files until `incoming` more bytes fit the budget (lock held)."""
        while self._files and self._bytes + incoming > self.max_bytes:
            number, f = self._files.popitem(last=False)
            self._bytes -= f.nbytes
            for key in f.keys:
                if self._index.get(key, (None,))[0] == number:
                    del self._index[key]
                    self._note((), (key,))
            f.path.unlink(missing_ok=True)
            self._stats.extra["evicted_files"] = self._stats.extra.get("evicted_files", 0) + 1

    def _drop_dead(self) -> None:
        """Delete files whose every page was rewritten in a later file (lock held)."""
        for number in [n for n, f in self._files.items() if f.live <= 0]:
            f = self._files.pop(number)
            self._bytes -= f.nbytes
            f.path.unlink(missing_ok=True)

    # ---- get ----

    def get(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        """Read the pages of `keys` into `slots`; a missing, truncated or corrupt page is False."""
        pool = self._require()
        slots = np.asarray(slots, dtype=np.int64)
        ok = np.zeros(len(keys), dtype=bool)
        with self._lock:
            where = [self._index.get(k) for k in keys]
            files = {w[0]: self._files[w[0]] for w in where if w is not None}
        missed = [k for k, w in zip(keys, where) if w is None]
        self._count("missed", len(missed))
        if missed:
            with self._lock:
                self._note((), missed)  # a scheduler that believed them here learns otherwise
        by_file: dict[int, list[int]] = {}
        for pos, w in enumerate(where):
            if w is not None:
                by_file.setdefault(w[0], []).append(pos)
        for number, positions in by_file.items():
            self._read_file(files[number], keys, np.array(positions), where, slots, ok, pool)
        return ok

    def _read_file(self, f: _File, keys: Sequence[bytes], positions: np.ndarray, where: list,
                   slots: np.ndarray, ok: np.ndarray, pool: PoolView) -> None:
        """Read one file's pages straight into their slots, then check them there."""
        in_file = np.array([where[p][1] for p in positions], dtype=np.int64)
        order = np.argsort(in_file, kind="stable")
        positions, in_file = positions[order], in_file[order]
        dst = slots[positions]
        whole = np.zeros(positions.size, dtype=bool)
        try:
            fd = os.open(f.path, os.O_RDONLY)
        except OSError:
            self._reject(keys, positions, "its batch file is gone")
            return
        try:
            # Runs of consecutive pages in the file: one read per region and run, a buffer per run of slots.
            breaks = np.flatnonzero(np.diff(in_file) != 1) + 1
            for run in np.split(np.arange(positions.size), breaks):
                first, got_pages = int(in_file[run[0]]), run.size
                for rows, offset in zip(pool.rows, _region_offsets(pool, f.data_offset, f.count)):
                    width = rows.shape[1]
                    got = _read_all(fd, _run_views(rows, dst[run]), offset + first * width)
                    got_pages = min(got_pages, got // width)
                whole[run[:got_pages]] = True
        finally:
            os.close(fd)
        good = np.zeros(positions.size, dtype=bool)
        if whole.any():
            idx = np.flatnonzero(whole)
            expected = np.array([where[positions[i]][2] for i in idx], dtype=np.uint64)
            good[idx] = slot_checksums([keys[positions[i]] for i in idx], pool, dst[idx]) == expected
        ok[positions[good]] = True
        self._count("loaded", int(good.sum()), int(good.sum()) * pool.page_bytes)
        if not good.all():
            self._reject(keys, positions[~good], "truncated or failed its checksum")

    def _reject(self, keys: Sequence[bytes], positions: np.ndarray, why: str) -> None:
        """Count and forget pages that cannot be trusted; log each once."""
        self._count("rejected", positions.size)
        with self._lock:
            for p in positions:
                key = keys[int(p)]
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("disk tier %s: page %s %s; read as a miss", self.path, key.hex(), why)
                hit = self._index.pop(key, None)
                if hit is not None:
                    self._note((), (key,))
                    if hit[0] in self._files:
                        self._files[hit[0]].live -= 1

    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        """True per key indexed on disk."""
        with self._lock:
            return np.array([k in self._index for k in keys], dtype=bool)

    def _require(self) -> PoolView:
        if self._pool is None:
            raise KVConnectError("attach the disk tier to a pool before using it")
        return self._pool

    def close(self) -> None:
        """Let another process use the directory (the files stay: they are found again at the next start)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor releases the lock
            self._lock_fd = -1

    def used_bytes(self) -> int:
        """Bytes of batch files the tier holds now."""
        with self._lock:
            return self._bytes


def _region_offsets(pool: PoolView, data_offset: int, count: int) -> list[int]:
    """Where each region's rows start in a batch file of `count` pages (regions one after another)."""
    before = np.concatenate(([0], np.cumsum(pool.row_bytes)[:-1])).astype(np.int64)
    return (data_offset + count * before).tolist()


def _run_views(rows: np.ndarray, slots: np.ndarray) -> list[memoryview]:
    """One buffer per run of consecutive slots in `rows` (a fresh pool hands out runs)."""
    _, first, count = slot_runs(slots)
    return [memoryview(rows[a:a + n]).cast("B") for a, n in zip(first.tolist(), count.tolist())]


def _write_all(fd: int, views: list[memoryview], offset: int) -> None:
    """pwritev until every byte is written (the kernel may write less, and takes at most IOV_MAX buffers)."""
    for i in range(0, len(views), IOV_MAX):
        chunk = views[i:i + IOV_MAX]
        left = sum(v.nbytes for v in chunk)
        while left:
            n = os.pwritev(fd, chunk, offset)
            offset, left = offset + n, left - n
            chunk = _advance(chunk, n)


def _read_all(fd: int, views: list[memoryview], offset: int) -> int:
    """preadv until the buffers are full or the file ends; bytes read."""
    total = 0
    for i in range(0, len(views), IOV_MAX):
        chunk = views[i:i + IOV_MAX]
        left = sum(v.nbytes for v in chunk)
        while left:
            n = os.preadv(fd, chunk, offset)
            if n == 0:
                return total
            offset, left, total = offset + n, left - n, total + n
            chunk = _advance(chunk, n)
    return total


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The buffers after the first `n` bytes."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views
