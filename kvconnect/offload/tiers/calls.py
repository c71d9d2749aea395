"""Library calls on threads of their own, counted until they return.

A Mooncake Store call can block for the library's own timeout (30 s for a stalled master or storage
node), longer than a tier may wait; the tier waits for such a call up to its own deadline and
abandons it there. An abandoned call still runs and still uses its client and buffers, so it is
counted here: the client is closed only once no call is running (closing it under one crashes the
process).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from kvconnect.threads import spawn


class InFlight:
    """Calls started on threads of their own; `wait_idle` waits until every one returned."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._running = 0

    def start(self, fn: Callable[[], Any], name: str) -> threading.Thread:
        """Run `fn()` on a new daemon thread, counted until it returns."""
        with self._idle:
            self._running += 1

        def run() -> None:
            try:
                fn()
            finally:
                with self._idle:
                    self._running -= 1
                    self._idle.notify_all()

        return spawn(run, name=name)

    def wait_idle(self, timeout: float) -> int:
        """Wait up to `timeout` s until no call runs; how many still do."""
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0, timeout)
            return self._running
