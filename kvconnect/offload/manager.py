"""The scheduler side of the offload tier: which keys are held, in which slot, and what to evict.

No bytes here. A key is resident from `prepare_store` on, but visible to `lookup` and `prepare_load`
only once `complete_store(ok=True)` published it. Keys being stored, and keys pinned by loads, are
never evicted, so a slot is never rewritten while a copy reads or writes it. Thread-safe: the
caller's thread prepares, worker threads complete.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from kvconnect import metrics
from kvconnect.errors import KVConnectError
from kvconnect.offload.policy import EvictionPolicy, make_policy

Key = Hashable


@dataclass
class _Entry:
    slot: int
    ready: bool = False
    pins: int = 0


@dataclass(frozen=True)
class StorePlan:
    """Blocks one store will copy: `keys[i]` (at `positions[i]` of the request) goes to `slots[i]`."""

    keys: tuple[Key, ...]
    positions: np.ndarray
    slots: np.ndarray
    already_present: int
    dropped: int

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class LoadPlan:
    """Blocks one load will copy: the block of `keys[i]` is read from `slots[i]`."""

    keys: tuple[Key, ...]
    slots: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class OffloadStats:
    """Counters since the tier was created; block counts unless the name says bytes."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    stores: int = 0
    loads: int = 0
    evictions: int = 0
    dropped: int = 0
    promoted: int = 0
    failed_stores: int = 0
    failed_loads: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    resident: int = 0
    in_flight: int = 0
    capacity: int = 0

    @property
    def bytes_moved(self) -> int:
        """Bytes copied in both directions by completed jobs."""
        return self.bytes_stored + self.bytes_loaded


class OffloadManager:
    """Key to slot map of a tier of `num_slots` slots, with an eviction policy and pin counts."""

    def __init__(self, num_slots: int, policy: str | EvictionPolicy = "lru", slot_bytes: int = 0):
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise KVConnectError(f"num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.policy: EvictionPolicy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        if self.policy.capacity != num_slots:
            raise KVConnectError(f"policy capacity {self.policy.capacity} differs from {num_slots} slots")
        self._entries: dict[Key, _Entry] = {}
        # Lowest slot first, so a fresh tier hands out runs and the mover copies each run in one op.
        self._free = list(range(num_slots))
        self._lock = threading.RLock()
        self._stats = OffloadStats(capacity=num_slots)

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading keys are stored and published; unknown keys are misses, never errors."""
        with self._lock:
            hits = 0
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not entry.ready:
                    break
                hits += 1
            self._stats.lookups += 1
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
            metrics.offload_hits.inc(hits)
            metrics.offload_misses.inc(len(keys) - hits)
            return hits

    def contains(self, key: Key) -> bool:
        """Whether `key` is published (no stats, no recency change)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.ready

    def absent(self, key: Key) -> bool:
        """Whether `key` has no slot at all: neither published nor on its way in (no stats)."""
        with self._lock:
            return key not in self._entries

    def touch(self, keys: Sequence[Key]) -> None:
        """Record a use of every published key among `keys`, the first one ending most recent."""
        with self._lock:
            used = [k for k in keys if k in self._entries and self._entries[k].ready]
            for key in used:
                self.policy.touch(key)
            self.policy.reorder(used)

    def prepare_store(self, keys: Sequence[Key], leading: bool = False) -> StorePlan:
        """Allocate slots for the keys not yet held, evicting as needed; keys that find no room are dropped.

        `leading`: allocate only the leading run of keys not held that all find room (a promotion from
        a lower tier, which is useful only as a prefix), stopping at the first key held or without room.
        """
        with self._lock:
            present = {k for k in keys if k in self._entries}
            # This request's own blocks are a use, and must not be evicted to make room for its tail.
            self.touch([k for k in keys if k in present])
            entries = self._entries

            def evictable(k: Key) -> bool:
                e = entries[k]
                return e.ready and e.pins == 0 and k not in present

            new_keys: list[Key] = []
            positions: list[int] = []
            slots: list[int] = []
            seen: set[Key] = set()
            skipped = dropped = 0
            room = True
            for pos, key in enumerate(keys):
                if leading and (key in present or not room):
                    break
                if key in present:
                    skipped += 1
                    continue
                if key in seen:
                    continue  # a repeated key within the request is stored once
                seen.add(key)
                victims = self.policy.admit(key, evictable) if room else None
                if victims is None:
                    # Full of blocks in flight or of this request: keep the prefix that fits.
                    room = False
                    if leading:
                        break
                    dropped += 1
                    continue
                for victim in victims:
                    heapq.heappush(self._free, self._entries.pop(victim).slot)
                self._stats.evictions += len(victims)
                metrics.offload_evictions.inc(len(victims))
                slot = heapq.heappop(self._free)
                self._entries[key] = _Entry(slot)
                new_keys.append(key)
                positions.append(pos)
                slots.append(slot)
            self.policy.reorder([k for k in keys if k in self._entries])
            self._stats.dropped += dropped
            self._stats.in_flight += len(new_keys)
            return StorePlan(tuple(new_keys), np.asarray(positions, dtype=np.int64),
                             np.asarray(slots, dtype=np.int64), skipped, dropped)

    def complete_store(self, plan: StorePlan, ok: bool, slot_bytes: int | None = None, *,
                       pin: bool = False, promoted: bool = False) -> None:
        """Publish the plan's keys, or on failure publish none of them and free their slots.

        `slot_bytes`: bytes each block moved (a group's part of a slot), default the whole slot.
        `pin`: publish them pinned (a copy to a lower tier follows; `unpin` when it is done), so no
        store can evict them in between. `promoted`: they came up from a lower tier, not from the
        engine, so they are not counted as stores.
        """
        with self._lock:
            for key in plan.keys:
                entry = self._entries[key]
                if ok:
                    entry.ready = True
                    entry.pins += pin
                    continue
                del self._entries[key]
                self.policy.remove(key)
                heapq.heappush(self._free, entry.slot)
            self._stats.in_flight -= len(plan)
            if promoted:
                self._stats.promoted += len(plan) if ok else 0
            elif ok:
                self._stats.stores += len(plan)
                self._stats.bytes_stored += len(plan) * (self.slot_bytes if slot_bytes is None else slot_bytes)
            else:
                self._stats.failed_stores += 1

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        """Pin the slots of published keys for a load; refuses (pinning nothing) if any key is not published."""
        with self._lock:
            slots = np.empty(len(keys), dtype=np.int64)
            for pos, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or not entry.ready:
                    raise KVConnectError(
                        f"key at position {pos} is not in the offload tier ({'being stored' if entry else 'absent'}); "
                        "load only what lookup() reported"
                    )
                slots[pos] = entry.slot
            for key in keys:
                self._entries[key].pins += 1
                self.policy.touch(key)
            self.policy.reorder(keys)
            self._stats.in_flight += len(keys)
            return LoadPlan(tuple(keys), slots)

    def pin(self, keys: Sequence[Key]) -> np.ndarray:
        """Pin published `keys` against eviction (a copy to a lower tier reads them); their slots."""
        with self._lock:
            entries = [self._entries[k] for k in keys]
            if not all(e.ready for e in entries):
                raise KVConnectError("only published keys can be pinned")
            for e in entries:
                e.pins += 1
            return np.array([e.slot for e in entries], dtype=np.int64)

    def unpin(self, keys: Sequence[Key]) -> None:
        """Undo one `pin` of `keys`."""
        with self._lock:
            for key in keys:
                self._entries[key].pins -= 1

    def published(self, keys: Sequence[Key]) -> np.ndarray:
        """True per key published in the tier (no stats, no recency change)."""
        with self._lock:
            return np.array([(e := self._entries.get(k)) is not None and e.ready for k in keys], dtype=bool)

    def prepare_load_prefix(self, keys: Sequence[Key]) -> LoadPlan:
        """Lookup and pin in one step: the leading published keys, which no eviction can take in between."""
        with self._lock:
            return self.prepare_load(list(keys)[: self.lookup(keys)])

    def complete_load(self, plan: LoadPlan, ok: bool, slot_bytes: int | None = None) -> None:
        """Unpin the plan's slots; the blocks stay in the tier either way (`slot_bytes` as in complete_store)."""
        with self._lock:
            for key in plan.keys:
                self._entries[key].pins -= 1
            self._stats.in_flight -= len(plan)
            if ok:
                self._stats.loads += len(plan)
                self._stats.bytes_loaded += len(plan) * (self.slot_bytes if slot_bytes is None else slot_bytes)
            else:
                self._stats.failed_loads += 1

    def stats(self) -> OffloadStats:
        """A snapshot of the counters."""
        with self._lock:
            snap = OffloadStats(**{f: getattr(self._stats, f) for f in self._stats.__dataclass_fields__})
            snap.resident = sum(1 for e in self._entries.values() if e.ready)
            return snap

    def held(self) -> int:
        """Slots in use, published or in flight."""
        with self._lock:
            return len(self._entries)

    def slot_of(self, key: Key) -> int | None:
        """The slot holding `key` (published or in flight), for tests and debugging."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.slot

    def pinned(self) -> int:
        """Keys with a load in flight."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.pins)
