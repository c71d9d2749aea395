"""Eviction policies of the offload tier: LRU and ARC, over opaque keys.

A policy only orders keys; it never sees bytes or slots. The manager tells it which residents may be
evicted right now (blocks being stored or loaded may not), and the policy picks among those. Both
policies hold exactly `capacity` residents at most: `admit` makes room first or refuses.

The manager reorders the blocks of one request so that its first block is the most recent: with
chained keys a prefix is useless without its head, so a prefix should lose its tail first (vLLM's
offload LRU touches blocks in reverse for the same reason).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Protocol, Sequence

from kvconnect.errors import KVConnectError

Key = Hashable
Evictable = Callable[[Key], bool]


class EvictionPolicy(Protocol):
    """What the manager needs from a policy."""

    capacity: int

    def admit(self, key: Key, evictable: Evictable) -> list[Key] | None:
        """Make `key` resident; return the residents evicted for it, or None (nothing changed) if no room."""

    def touch(self, key: Key) -> None:
        """Record a use of a resident key."""

    def remove(self, key: Key) -> None:
        """Forget a resident key that never held data (a failed store), leaving no history."""

    def reorder(self, keys: Sequence[Key]) -> None:
        """Make resident `keys[0]` the most recent of them, `keys[-1]` the least, changing nothing else."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


def _first(order: OrderedDict, evictable: Evictable) -> Key | None:
    """The least recently used key in `order` that may be evicted."""
    for key in order:
        if evictable(key):
            return key
    return None


def _check_capacity(capacity: int) -> int:
    if not isinstance(capacity, int) or capacity <= 0:
        raise KVConnectError(f"policy capacity must be a positive int, got {capacity!r}")
    return capacity


class LRUPolicy:
    """Least recently used: evict the evictable resident whose last use is oldest."""

    def __init__(self, capacity: int):
        self.capacity = _check_capacity(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def admit(self, key: Key, evictable: Evictable) -> list[Key] | None:
        """Make `key` the most recent resident, evicting the oldest evictable one if full."""
        if key in self._order:
            raise KVConnectError(f"key {key!r} is already resident")
        victims: list[Key] = []
        if len(self._order) >= self.capacity:
            victim = _first(self._order, evictable)
            if victim is None:
                return None
            del self._order[victim]
            victims.append(victim)
        self._order[key] = None
        return victims

    def touch(self, key: Key) -> None:
        """Mark `key` most recently used."""
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        """Forget `key`."""
        self._order.pop(key, None)

    def reorder(self, keys: Sequence[Key]) -> None:
        """Make `keys[0]` the most recent of `keys`: a prefix then loses its tail first."""
        for key in reversed(keys):
            if key in self._order:
                self._order.move_to_end(key)

    def residents(self) -> list[Key]:
        """Residents, least recently used first."""
        return list(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), with unevictable residents skipped.

    T1 holds keys used once recently, T2 keys used at least twice; B1/B2 are ghost lists remembering
    keys recently evicted from T1/T2. A miss that hits a ghost list moves the target size `p` of T1
    towards the list that would have kept it, so a one-time scan churns T1 while T2 keeps the hot set.
    Where the paper evicts the LRU end of a list, this evicts the least recent *evictable* key there,
    and falls back to the other list when the preferred one has none.
    """

    def __init__(self, capacity: int):
        self.capacity = _check_capacity(capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def _replace(self, in_b2: bool, p: float, evictable: Evictable) -> tuple[OrderedDict, Key] | None:
        """The paper's REPLACE: which list to evict from, then the victim in it."""
        n1 = len(self.t1)
        prefer_t1 = n1 >= 1 and ((in_b2 and n1 == p) or n1 > p)
        for lst in ((self.t1, self.t2) if prefer_t1 else (self.t2, self.t1)):
            victim = _first(lst, evictable)
            if victim is not None:
                return lst, victim
        return None

    def _evict_to_ghost(self, lst: OrderedDict, victim: Key) -> Key:
        del lst[victim]
        (self.b1 if lst is self.t1 else self.b2)[victim] = None
        return victim

    def admit(self, key: Key, evictable: Evictable) -> list[Key] | None:
        """Handle a miss on `key` as ARC does (cases II-IV), then make it resident."""
        if key in self.t1 or key in self.t2:
            raise KVConnectError(f"key {key!r} is already resident")
        c = self.capacity
        # The paper's cache is always full once warm; here failed stores can leave holes, so only
        # replace when there is no free slot.
        full = len(self.t1) + len(self.t2) >= c
        if key in self.b1 or key in self.b2:
            in_b2 = key in self.b2
            if in_b2:
                p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            else:
                p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            chosen = self._replace(in_b2, p, evictable) if full else None
            if full and chosen is None:
                return None
            self.p = p
            victims = [self._evict_to_ghost(*chosen)] if chosen else []
            (self.b2 if in_b2 else self.b1).pop(key)
            self.t2[key] = None
            return victims
        victims = []
        l1 = len(self.t1) + len(self.b1)
        if l1 >= c:
            if len(self.t1) < c:
                chosen = self._replace(False, self.p, evictable) if full else None
                if full and chosen is None:
                    return None
                if self.b1:
                    self.b1.popitem(last=False)
                if chosen:
                    victims.append(self._evict_to_ghost(*chosen))
            else:
                # T1 is the whole cache: its LRU leaves without a ghost.
                victim = _first(self.t1, evictable)
                if victim is None:
                    return None
                del self.t1[victim]
                victims.append(victim)
        elif l1 + len(self.t2) + len(self.b2) >= c:
            chosen = self._replace(False, self.p, evictable) if full else None
            if full and chosen is None:
                return None
            if l1 + len(self.t2) + len(self.b2) >= 2 * c and self.b2:
                self.b2.popitem(last=False)
            if chosen:
                victims.append(self._evict_to_ghost(*chosen))
        self.t1[key] = None
        return victims

    def touch(self, key: Key) -> None:
        """A hit: the key moves to the most recent end of T2."""
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key)
        self.t2[key] = None

    def remove(self, key: Key) -> None:
        """Forget `key` without a ghost: it never held data, so it says nothing about the workload."""
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def reorder(self, keys: Sequence[Key]) -> None:
        """Make `keys[0]` the most recent of `keys` within its own list (T1 or T2); no key changes list."""
        for key in reversed(keys):
            if key in self.t1:
                self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)

    def residents(self) -> list[Key]:
        """Residents: T1 then T2, each least recently used first."""
        return list(self.t1) + list(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


POLICIES: dict[str, type] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called `name` ("lru" or "arc") holding at most `capacity` keys."""
    try:
        cls = POLICIES[name.lower()]
    except (KeyError, AttributeError):
        raise KVConnectError(f"unknown eviction policy {name!r} (choose {', '.join(POLICIES)})") from None
    return cls(capacity)
