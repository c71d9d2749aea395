"""Asynchronous copy jobs: a handle the caller polls or waits on, and the worker threads that run them.

A job's bookkeeping (publishing stored keys, unpinning loaded ones) runs on the worker before the job
is marked done, so once `wait` returns a stored block is already visible to `lookup`. Torch copies
release the GIL, so a worker thread overlaps real work with the caller.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from typing import Callable, Hashable

import numpy as np

from kvconnect.errors import KVConnectError, TransferError
from kvconnect.threads import spawn

_ids = itertools.count(1)


class OffloadJob:
    """One store or load: `done`, `ok` and `error` tell how it ended."""

    def __init__(self, kind: str, keys: tuple[Hashable, ...], block_ids: np.ndarray, nbytes: int,
                 work: Callable[[], None] | None, finish: Callable[[BaseException | None], None] | None):
        self.id = next(_ids)
        self.kind = kind
        self.keys = keys
        self.block_ids = block_ids
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self._work = work
        self._finish = finish
        self._done = threading.Event()

    @property
    def num_blocks(self) -> int:
        """Blocks this job moves (a store skips blocks already in the tier)."""
        return len(self.keys)

    @property
    def done(self) -> bool:
        """The job ended, successfully or not."""
        return self._done.is_set()

    @property
    def ok(self) -> bool:
        """The job ended and moved every block."""
        return self._done.is_set() and self.error is None

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds; True when the job ended."""
        return self._done.wait(timeout)

    def _run(self) -> None:
        try:
            if self._work is not None:
                self._work()
        except BaseException as exc:  # noqa: BLE001 - reported through the job, never swallowed
            self.error = exc
        finally:
            try:
                if self._finish is not None:
                    self._finish(self.error)
            except BaseException as exc:  # noqa: BLE001
                self.error = self.error or exc
            self._work = self._finish = None

    def _cancel(self, reason: str) -> None:
        self.error = TransferError(f"{self.kind} job {self.id} cancelled: {reason}")
        if self._finish is not None:
            self._finish(self.error)
        self._work = self._finish = None

    def __repr__(self) -> str:
        state = "pending" if not self.done else ("ok" if self.error is None else f"failed: {self.error}")
        return f"OffloadJob({self.id}, {self.kind}, {self.num_blocks} blocks, {state})"


class JobRunner:
    """Worker threads running jobs in submission order (one worker: strictly in order)."""

    def __init__(self, workers: int = 1, name: str = "kvconnect-offload"):
        if workers <= 0:
            raise KVConnectError(f"workers must be positive, got {workers}")
        self._queue: queue.Queue[OffloadJob | None] = queue.Queue()
        self._finished: deque[OffloadJob] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [spawn(self._loop, name=f"{name}-{i}") for i in range(workers)]

    def submit(self, job: OffloadJob) -> OffloadJob:
        """Queue a job for a worker."""
        with self._lock:
            if self._closed:
                raise KVConnectError("the offload connector is closed")
            self._queue.put(job)
        return job

    def finish_now(self, job: OffloadJob) -> OffloadJob:
        """Complete a job with nothing to copy on the caller's thread, reported like any other."""
        self._complete(job)
        return job

    def _complete(self, job: OffloadJob) -> None:
        job._run()
        self._report(job)

    def _report(self, job: OffloadJob) -> None:
        # Together under the lock: poll() never returns a job that is not done, and a job that
        # wait() saw done is already in the next poll().
        with self._lock:
            self._finished.append(job)
            job._done.set()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._complete(job)

    def poll(self) -> list[OffloadJob]:
        """Jobs that ended since the previous poll, in the order they ended."""
        with self._lock:
            out = list(self._finished)
            self._finished.clear()
        return out

    def close(self, timeout: float) -> None:
        """Run what is queued, then stop the workers; TransferError if they are not done within `timeout`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            # Jobs still queued behind a stuck copy will never run: end them as cancelled.
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job._cancel("connector closed")
                    self._report(job)
            raise TransferError(f"offload workers still copying after {timeout} s: {', '.join(alive)}")
