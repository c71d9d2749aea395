"""Runs: where consecutive entries of one or more sequences continue each other, found with numpy.

Block ids that go up by one, or byte ranges that start where the previous one ended, on every side
at once, become one run: one descriptor instead of one per entry. Pure functions, no kvconnect import.
"""

from __future__ import annotations

import numpy as np


def runs(*starts: np.ndarray, step: np.ndarray | int = 1,
         apart: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(first index, entry count) of each run: entry i+1 continues entry i where every sequence of `starts`
    moved by exactly `step` (per entry, or one for all) and `apart[i]` (when given) is False."""
    n = starts[0].size
    if n == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    gap = step[:-1] if isinstance(step, np.ndarray) else step
    joins = np.ones(n - 1, dtype=bool)
    for seq in starts:
        joins &= seq[:-1] + gap == seq[1:]
    if apart is not None:
        joins &= ~apart
    first = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    return first, np.diff(np.append(first, n))
