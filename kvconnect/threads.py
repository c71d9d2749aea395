"""kvconnect's own threads: daemon threads that may run on any CPU the process may use.

Serving engines pin their compute threads to cores (vLLM's CPU backend binds each worker's OpenMP
threads), and a thread inherits the CPU affinity of the thread that starts it. kvconnect's threads
(the side-channel listener, one worker per producer, heartbeats, transfer workers) are I/O threads
that wait most of the time; pinned to a core that a worker's compute threads keep busy, they were
seen to miss deadlines by minutes when two engines shared a 2-core host. So every thread kvconnect
starts first widens its own affinity to every CPU the process may use, and `unpinned` runs set-up
code (which starts library threads: ZMQ I/O, NIXL, Mooncake) in such a thread.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, TypeVar

import zmq

T = TypeVar("T")


def unpin() -> None:
    """Let the calling thread run on any CPU the process may use (best effort; a no-op off Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        # The kernel keeps only the CPUs the process's cpuset allows.
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pass


def spawn(target: Callable[..., Any], *, name: str, args: tuple = ()) -> threading.Thread:
    """Start a daemon thread that unpins itself before running `target(*args)`."""

    def run() -> None:
        unpin()
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def unpinned(fn: Callable[[], T]) -> T:
    """Run `fn()` in a thread that may use every CPU, and return its result (or raise its exception).

    Threads that `fn` starts, its libraries' included, inherit that affinity.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    spawn(run, name="kvconnect-setup").join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def zmq_context() -> zmq.Context:
    """A ZMQ context whose I/O threads may run on any CPU the process may use."""

    def make() -> zmq.Context:
        ctx = zmq.Context()
        # libzmq starts a context's I/O and reaper threads with its first socket: start them here, unpinned.
        ctx.socket(zmq.PAIR).close(linger=0)
        return ctx

    return unpinned(make)
