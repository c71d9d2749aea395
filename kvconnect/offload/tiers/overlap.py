"""A helper thread for the lower tiers: checksums computed while the bytes move.

A tier's put or get is one thread's work: it writes or reads pages (the kernel or Mooncake copies
them, with the GIL released) and hashes them (xxhash releases the GIL too). Run one after the other,
the hash adds its whole time to every batch; handed to this thread, it runs on another core while
the caller moves the next bytes. One thread per process serves every tier: hashing is stateless and
the host has few cores to give. The thread may run on any CPU the process may use (`spawn`).
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

from kvconnect.errors import KVConnectError
from kvconnect.threads import spawn

T = TypeVar("T")

# A job shorter than this costs about as much in waking the helper thread as it overlaps (measured
# with `kvconnect bench offload --tier disk`): smaller batches are hashed on the caller's thread.
# xxhash releases the GIL only for buffers longer than 64 KiB (python-xxhash's XXHASH_GIL_MINSIZE,
# a strict comparison): a job hashing shorter rows holds the GIL between its calls, so a caller whose
# read returns meanwhile waits for the GIL until that hash call ends; jobs start a hash only once the
# caller has started its own I/O, or hash in pieces between reads of their own (`disk_load`'s lanes).
HANDOFF_BYTES = 2 << 20

# A batch's checksums take milliseconds; a helper this late is stuck, and the batch fails (typed).
WAIT_S = 60.0

_started = threading.Lock()
_helper: dict[str, object] = {}  # the process that started the thread, and the thread's queue


def _loop(jobs: queue.SimpleQueue) -> None:
    while True:
        future, fn = jobs.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller that waits for it
                future.set_exception(exc)


def later(fn: Callable[[], T]) -> Future:
    """Run `fn()` on the tiers' helper thread; its Future (wait for it with `result`)."""
    with _started:
        # A forked child has no helper thread even though its parent started one: start its own.
        if _helper.get("pid") != os.getpid():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            spawn(_loop, name="kvconnect-tier-hash", args=(jobs,))
            _helper.update(pid=os.getpid(), jobs=jobs)
        jobs = _helper["jobs"]
    future: Future = Future()
    jobs.put((future, fn))
    return future


def result(future: Future) -> T:
    """The value of a `later` call, waited for at most WAIT_S (a KVConnectError past it)."""
    try:
        return future.result(WAIT_S)
    except TimeoutError:
        raise KVConnectError(f"the tier helper thread did not answer within {WAIT_S:.0f} s") from None
