"""The local-disk tier: pages written a batch per file under one directory, with a byte budget.

Each put writes one batch file (`batchfile` holds its format); a crash leaves either a whole file or
a leftover `.tmp` that the next start deletes. At start the tier reads every file's header and table
and finds its pages again (a restarted engine keeps its prefixes). Files of another format version,
layout or namespace (another model, salt or block size) are left alone; a file of ours that is cut
short or fails its header or table checksum is deleted (logged), and no file stops the start.

The checksums cost about as much as reading the pages from the page cache, so they overlap the I/O
(`overlap`): a store hashes its pages on the helper thread while they are written; a load
(`disk_load`) reads and hashes in two lanes, each half of the pages, so that one lane hashes while
the other's read runs (a load too small to pay for the hand-off hashes its rows between the reads).

Eviction is whole files, oldest first, when a new batch would pass `max_bytes`. Reads go into the
slots that a promotion allocated and not yet published, and each page's checksum is checked there:
a torn or flipped page fails the load of that promotion and its slot is freed, so it never reaches a
block the engine reads.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kvconnect.errors import KVConnectError
from kvconnect.offload.tiers import overlap
from kvconnect.offload.tiers.base import PoolView, Tier
from kvconnect.offload.tiers.batchfile import (
    SUFFIX, CorruptBatchFile, data_start, encode_head, file_name, file_number, read_table, write_batch,
)
from kvconnect.offload.tiers.disk_load import load_pages
from kvconnect.offload.tiers.integrity import namespace_of, slot_checksums

__all__ = ["SUFFIX", "DiskTier"]

log = logging.getLogger("kvconnect.offload.disk")


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
            self._probe()
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

    def _probe(self) -> None:
        """Write and remove a small file: a directory that cannot be written fails the engine at start.

        A full disk is not such a directory: the tier starts, serves what it holds and drops stores
        until there is room again (an engine restarted on a full cache disk must not stay down).
        """
        probe = self.path / f".probe-{os.getpid()}"
        try:
            probe.write_bytes(b"kvconnect")
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.warning("disk tier %s: the disk is full (%s); starting anyway: stores are dropped until there "
                        "is room", self.path, exc.strerror or exc)
        finally:
            probe.unlink(missing_ok=True)

    # ---- setup and restart ----

    def attach(self, pool: PoolView) -> None:
        """Bind to the pool and find the pages of earlier runs with the same namespace and page size."""
        self._pool = pool
        self._ns = namespace_of(self.namespace, pool.page_bytes)
        for leftover in self.path.glob(f"*{SUFFIX}.tmp"):
            leftover.unlink(missing_ok=True)
        found = sorted(self.path.glob(f"*{SUFFIX}"), key=file_number)
        for path in found:
            self._adopt(path)
        self._recount()
        self._drop_dead(set(self._files))  # files whose every page a later file holds
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
        for file in sorted(Path(path).glob(f"*{SUFFIX}"), key=file_number):
            try:
                table = read_table(file, ns, page_bytes)
            except (OSError, CorruptBatchFile):
                continue  # the worker's tier deletes a corrupt file when it starts
            if table is not None:
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

    def _adopt(self, path: Path) -> None:
        number = file_number(path)
        if number < 0:
            return
        try:
            table = read_table(path, self._ns, self._pool.page_bytes)
        except CorruptBatchFile as exc:
            log.warning("disk tier: deleting corrupt batch file %s (%s); its pages are misses", path, exc)
            path.unlink(missing_ok=True)
            return
        except Exception as exc:  # noqa: BLE001 - no file may stop the engine from starting
            log.warning("disk tier: skipping unreadable batch file %s (%s)", path, exc)
            return
        if table is None:
            return  # another version, layout or model: not ours to read or delete
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
        if len(set(map(len, new_keys))) != 1:
            raise KVConnectError("disk tier keys must all have one length")
        data_offset = data_start(len(new_keys), len(new_keys[0]))
        nbytes = len(new_keys) * pool.page_bytes
        size = data_offset + nbytes
        with self._lock:
            number = self._next
            self._next += 1
            self._evict(size)
        path = self.path / file_name(number)
        try:
            # The checksums are computed on the helper thread while the pages are written.
            sums = write_batch(path, data_offset, pool, new_slots,
                               lambda: overlap.later(lambda: slot_checksums(new_keys, pool, new_slots)),
                               lambda s: encode_head(self._ns, pool.page_bytes, new_keys, s)[0])
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
            rewritten: set[int] = set()  # files that lost a page to this one
            for i, (key, checksum) in enumerate(zip(new_keys, sums.tolist())):
                old = self._index.get(key)
                if old is not None:
                    self._files[old[0]].live -= 1
                    rewritten.add(old[0])
                self._index[key] = (number, i, checksum)
            self._files[number].live = len(new_keys)
            self._note(new_keys, ())
            self._drop_dead(rewritten)
        self._count("stored", len(new_keys), nbytes)
        ok[fresh] = True
        return ok

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

    def _drop_dead(self, numbers: set[int]) -> None:
        """Delete those of files `numbers` that hold no live page any more (lock held).

        Only the files that just lost pages are looked at: a scan of every file per put would cost a
        long-lived tier of many small batches milliseconds per put.
        """
        for number in numbers:
            f = self._files.get(number)
            if f is not None and f.live <= 0:
                del self._files[number]
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
        try:
            fd = os.open(f.path, os.O_RDONLY)
        except OSError:
            self._reject(keys, positions, "its batch file is gone")
            return
        try:
            whole, sums = load_pages(fd, pool, f.data_offset, f.count, in_file, dst, [keys[p] for p in positions])
        finally:
            os.close(fd)
        good = whole & (sums == np.array([where[p][2] for p in positions], dtype=np.uint64))
        ok[positions[good]] = True
        self._count("loaded", int(good.sum()), int(good.sum()) * pool.page_bytes)
        if not good.all():
            self._reject(keys, positions[~good], "truncated or failed its checksum")

    def _reject(self, keys: Sequence[bytes], positions: np.ndarray, why: str) -> None:
        """Count and forget pages that cannot be trusted; log each once."""
        self._count("rejected", positions.size)
        emptied: set[int] = set()  # files that lost a page here
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
                        emptied.add(hit[0])
            self._drop_dead(emptied)

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
