"""The one timer the benchmarks share: the best of repeated calls."""

from __future__ import annotations

import time
from typing import Callable


def best_seconds(once: Callable[[], object], repeat: int, *, before: Callable[[], object] | None = None,
                 warmup: bool = False) -> float:
    """The shortest of `repeat` timed calls of `once` (`before` runs untimed ahead of each; `warmup`: one
    untimed call first)."""
    if warmup:
        once()
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return best
