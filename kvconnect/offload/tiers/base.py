"""The interface of a lower tier: batches of pages between the tier and slots of the host pool.

A page is one block of every region of the host pool (the pool keeps one `(num_slots, row_bytes)`
array per region, so a page is a row of each). Tiers never see the engine's KV cache: they fill and
drain pool slots, and the host tier's mover copies between slots and blocks. Keys are the offload
tier's content keys (bytes); a tier stores each page with its key and a checksum and checks both on
every read, so what a tier cannot vouch for is a miss, never wrong bytes.

Every call is a batch and returns a bool array (one per key): stored, or found and verified. Nothing
raises for a page that is missing, truncated, corrupt or unreachable; those are counted in `stats()`
(and logged once per page by the tier). Calls are made from the tier chain's worker thread, never from
the engine's step, and each is bounded (the tier's own timeout).
"""

from __future__ import annotations

import copy
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvconnect import metrics
from kvconnect.offload.quarantine import SlotQuarantine


@dataclass(frozen=True)
class PoolView:
    """The host pool as a tier sees it: one `(num_slots, row_bytes)` uint8 array per region.

    `quarantine` holds the slots that an abandoned call may still write (`kvconnect.offload.quarantine`);
    give the mover's when the pool is the mover's, so that it drops a store into one of them.
    """

    rows: tuple[np.ndarray, ...]
    quarantine: SlotQuarantine | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        slots = {r.shape[0] for r in self.rows}
        if not self.rows or len(slots) != 1 or any(r.dtype != np.uint8 or r.ndim != 2 for r in self.rows):
            raise ValueError("a pool view is one (num_slots, row_bytes) uint8 array per region, equal slot counts")
        if any(not r.flags.c_contiguous for r in self.rows):
            raise ValueError("pool arrays must be C-contiguous")
        if self.quarantine is None:
            object.__setattr__(self, "quarantine", SlotQuarantine(self.num_slots))

    @property
    def num_slots(self) -> int:
        """Slots in the pool."""
        return self.rows[0].shape[0]

    @property
    def row_bytes(self) -> np.ndarray:
        """Bytes of one slot's row, per region."""
        return np.array([r.shape[1] for r in self.rows], dtype=np.uint64)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: a row of every region."""
        return int(self.row_bytes.sum())

    def addresses(self, slots: np.ndarray) -> np.ndarray:
        """`(len(slots), regions)` uint64 addresses of each slot's row in each region."""
        bases = np.array([r.ctypes.data for r in self.rows], dtype=np.uint64)
        return bases[None, :] + np.asarray(slots, dtype=np.uint64)[:, None] * self.row_bytes[None, :]

    def gather(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The pages of `slots` as one `(len(slots), page_bytes)` array (one copy per region)."""
        slots = np.asarray(slots, dtype=np.int64)
        out = np.empty((slots.size, self.page_bytes), dtype=np.uint8) if out is None else out
        start = 0
        for r in self.rows:
            out[:, start:start + r.shape[1]] = r[slots]
            start += r.shape[1]
        return out


def leading(found: np.ndarray) -> int:
    """How many leading entries of a bool array are True (a prefix is what a lookup can use)."""
    return int(np.argmin(found)) if not found.all() else int(found.size)


@dataclass
class TierStats:
    """What a tier counts: pages stored, loaded, missed (absent), rejected (corrupt, truncated) and bytes."""

    stored: int = 0
    store_failed: int = 0
    loaded: int = 0
    missed: int = 0
    rejected: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self, prefix: str) -> dict[str, int]:
        """The counters as `{prefix}_{name}` keys, for stats files and JSON output."""
        out = {f"{prefix}_{k}": v for k, v in self.__dict__.items() if k != "extra"}
        out.update({f"{prefix}_{k}": v for k, v in self.extra.items()})
        return out


EVENTS = ("stored", "store_failed", "loaded", "missed", "rejected")


class Tier(ABC):
    """A store of pages by key below the host pool. Subclasses: DiskTier, StoreTier (and test doubles).

    Subclasses call `super().__init__()` and count every page with `_count`, which keeps `stats()` and
    the `kvconnect_offload_tier_pages_total{tier, event}` metric in step.
    """

    name: str = "tier"

    def __init__(self) -> None:
        self._stats = TierStats()
        self._stats_lock = threading.Lock()

    def _count(self, event: str, pages: int, nbytes: int = 0) -> None:
        """Count `pages` pages of `event` (one of EVENTS); `nbytes` adds to bytes stored or loaded."""
        if pages <= 0:
            return
        with self._stats_lock:
            setattr(self._stats, event, getattr(self._stats, event) + pages)
            if event == "stored":
                self._stats.bytes_stored += nbytes
            elif event == "loaded":
                self._stats.bytes_loaded += nbytes
        metrics.tier_pages.labels(self.name, event).inc(pages)

    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        with self._stats_lock:
            return copy.deepcopy(self._stats)

    @abstractmethod
    def attach(self, pool: PoolView) -> None:
        """Bind the tier to the host pool it moves pages from and to (once, before any other call)."""

    @abstractmethod
    def put(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        """Store the pages in pool `slots` under `keys`; True per page stored (a page already held counts)."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        """Read the pages of `keys` into pool `slots`; True per page found and verified (others: slot undefined)."""

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        """True per key the tier believes it holds (a later `get` still verifies)."""

    def close(self) -> None:
        """Release the tier's resources (files stay: a disk tier is found again after a restart)."""
