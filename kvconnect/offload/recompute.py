"""What an offload load saved against recomputing its tokens: an estimate from the engine's own steps.

The scheduler half times each engine step from the moment it hands the step to the workers to the
moment their output comes back (a step that overlapped the one before it counts from that one's end,
so idle time and overlap are never counted), and keeps a decayed, token-weighted mean of seconds per
scheduled token over the steps that ran no offload copy (a load or a store in the step would be
counted as compute). The worker credits each load `tokens x seconds per token - seconds the load
took`: negative when loading was slower than computing would have been. Decode steps cost more per
token than prefill ones, so on decode-heavy traffic the rate, and with it the saving, reads high.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


class ComputeRate:
    """This engine's seconds per scheduled token, from the wall time of the steps it ran."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, decay: float = 0.98):
        self._clock = clock
        self._decay = decay  # per timed step: the rate follows load and batch-size changes
        self._steps: deque[tuple[float, int]] = deque()  # (handed out at, tokens; 0: not timed)
        self._last_end = float("-inf")
        self._seconds = 0.0
        self._tokens = 0.0

    def built(self, tokens: int, timed: bool) -> None:
        """A step went to the workers with `tokens` scheduled; `timed` False leaves it out of the rate."""
        self._steps.append((self._clock(), tokens if timed else 0))

    def ran(self) -> None:
        """The oldest step handed out came back from the workers."""
        if not self._steps:
            return
        began, tokens = self._steps.popleft()
        now = self._clock()
        if tokens > 0:
            self._seconds = self._seconds * self._decay + (now - max(began, self._last_end))
            self._tokens = self._tokens * self._decay + tokens
        self._last_end = now

    @property
    def seconds_per_token(self) -> float:
        """The current rate; 0.0 until a step was timed."""
        return self._seconds / self._tokens if self._tokens else 0.0


def saved_seconds(tokens: int, load_seconds: float, seconds_per_token: float) -> float:
    """What loading `tokens` in `load_seconds` saved against computing them at `seconds_per_token` (may be negative)."""
    return tokens * seconds_per_token - load_seconds
