"""Host pool slots that a call abandoned at its deadline may still write: nothing else writes them until it returns.

A lower tier that reads straight into pool slots (the store tier's gets of long rows) bounds each
read by a deadline, but a library call cannot be cancelled: one given up on still writes its slots
when it returns. The page it was reading counts as missed, the scheduler frees the slots, and they
may be handed to another page at once. So the reader holds the slots here until the call returns,
and every other writer of pool slots in the process gives up on held slots at once, never waits
(the mover's store runs on the engine's step): the store is dropped, a later tier's fetch skips
them. A load reads only slots whose write completed since, so it never sees a late write. Holds
are counted, so two abandoned calls over one slot both keep it.
"""

from __future__ import annotations

import threading

import numpy as np


class SlotQuarantine:
    """Per-slot hold counts of one host pool."""

    def __init__(self, num_slots: int):
        self._held = np.zeros(num_slots, dtype=np.int32)
        self._count = 0  # slots held: the common "nothing held" answer costs no array work
        self._lock = threading.Lock()

    def hold(self, slots: np.ndarray) -> None:
        """Keep `slots` from every other writer until `release(slots)` (a call still writing them)."""
        held, times = np.unique(np.asarray(slots, dtype=np.int64), return_counts=True)
        with self._lock:
            self._held[held] += times.astype(np.int32)
            self._count = int(np.count_nonzero(self._held))

    def release(self, slots: np.ndarray) -> None:
        """End one `hold` of `slots` (the call that wrote them returned)."""
        held, times = np.unique(np.asarray(slots, dtype=np.int64), return_counts=True)
        with self._lock:
            if (self._held[held] < times).any():
                raise ValueError("released a slot that was not held")
            self._held[held] -= times.astype(np.int32)
            self._count = int(np.count_nonzero(self._held))

    def held(self, slots: np.ndarray) -> np.ndarray:
        """True per slot that a call may still write."""
        slots = np.asarray(slots, dtype=np.int64)
        if not self._count:
            return np.zeros(slots.shape, dtype=bool)
        with self._lock:
            return self._held[slots] > 0

    @property
    def count(self) -> int:
        """How many slots are held now."""
        return self._count
