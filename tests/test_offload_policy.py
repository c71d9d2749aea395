"""LRU and ARC eviction: each against an independent reference model, and ARC's scan resistance."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvconnect import KVConnectError
from kvconnect.offload.policy import ARCPolicy, LRUPolicy, make_policy


class RefLRU:
    """Plain list, most recent last; evicts the oldest key that is not pinned."""

    def __init__(self, c: int):
        self.c, self.keys = c, []

    def request(self, x, pinned=frozenset()):
        if x in self.keys:
            self.keys.remove(x)
            self.keys.append(x)
            return []
        victims = []
        if len(self.keys) == self.c:
            free = [k for k in self.keys if k not in pinned]
            if not free:
                return None
            self.keys.remove(free[0])
            victims = [free[0]]
        self.keys.append(x)
        return victims


class RefARC:
    """ARC transcribed from Megiddo & Modha (FAST '03), Fig. 4; lists hold the LRU end at index 0."""

    def __init__(self, c: int):
        self.c, self.p = c, 0.0
        self.T1, self.T2, self.B1, self.B2 = [], [], [], []

    def _replace(self, x):
        if self.T1 and ((x in self.B2 and len(self.T1) == self.p) or len(self.T1) > self.p):
            v = self.T1.pop(0)
            self.B1.append(v)
        else:
            v = self.T2.pop(0)
            self.B2.append(v)
        return v

    def request(self, x):
        c = self.c
        if x in self.T1 or x in self.T2:  # case I
            (self.T1 if x in self.T1 else self.T2).remove(x)
            self.T2.append(x)
            return []
        if x in self.B1:  # case II
            self.p = min(c, self.p + max(len(self.B2) / len(self.B1), 1))
            v = self._replace(x)
            self.B1.remove(x)
            self.T2.append(x)
            return [v]
        if x in self.B2:  # case III
            self.p = max(0, self.p - max(len(self.B1) / len(self.B2), 1))
            v = self._replace(x)
            self.B2.remove(x)
            self.T2.append(x)
            return [v]
        victims = []  # case IV
        l1, total = len(self.T1) + len(self.B1), len(self.T1) + len(self.B1) + len(self.T2) + len(self.B2)
        if l1 == c:
            if len(self.T1) < c:
                self.B1.pop(0)
                victims.append(self._replace(x))
            else:
                victims.append(self.T1.pop(0))
        elif l1 < c and total >= c:
            if total == 2 * c:
                self.B2.pop(0)
            victims.append(self._replace(x))
        self.T1.append(x)
        return victims


def _drive(policy, x, pinned=frozenset()):
    if x in policy:
        policy.touch(x)
        return []
    return policy.admit(x, lambda k: k not in pinned)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6),
       st.lists(st.tuples(st.integers(0, 12), st.sets(st.integers(0, 12), max_size=4)), max_size=120))
def test_lru_matches_the_reference_with_pinned_keys_never_evicted(c, trace) -> None:
    ours, ref = LRUPolicy(c), RefLRU(c)
    for x, pinned in trace:
        got, want = _drive(ours, x, pinned), ref.request(x, pinned)
        assert got == want
        assert ours.residents() == ref.keys
        assert not set(got or []) & pinned


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(2, 20).flatmap(lambda u: st.lists(st.integers(0, u), max_size=200)))
@example(3, [2, 1, 1, 3, 0, 2, 3, 1])  # a B2 ghost hit with |T1| == p: REPLACE must take T1's LRU
def test_arc_matches_the_paper_step_by_step(c, trace) -> None:
    ours, ref = ARCPolicy(c), RefARC(c)
    for x in trace:
        assert _drive(ours, x) == ref.request(x)
        assert (list(ours.t1), list(ours.t2), list(ours.b1), list(ours.b2)) == (ref.T1, ref.T2, ref.B1, ref.B2)
        assert ours.p == ref.p


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6),
       st.lists(st.tuples(st.integers(0, 15), st.sets(st.integers(0, 15), max_size=6), st.booleans()), max_size=150))
def test_arc_invariants_hold_with_pins_and_failed_stores(c, trace) -> None:
    arc = ARCPolicy(c)
    for x, pinned, fail in trace:
        before = (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2), arc.p)
        got = _drive(arc, x, pinned)
        if got is None:  # refused: nothing changed, and truly nothing was evictable
            assert (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2), arc.p) == before
            assert set(arc.residents()) <= pinned
            continue
        assert not set(got) & pinned and x in arc
        if fail and x in arc.t1:
            arc.remove(x)  # a failed store leaves no trace of the key
            assert x not in arc and x not in arc.b1 and x not in arc.b2
        lists = [set(arc.t1), set(arc.t2), set(arc.b1), set(arc.b2)]
        assert sum(map(len, lists)) == len(set().union(*lists)), "lists overlap"
        assert len(arc) <= c and len(arc.t1) + len(arc.b1) <= c
        assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 2 * c
        assert 0 <= arc.p <= c


def _scan(policy_cls):
    policy = policy_cls(4)
    for hot in ("a", "b"):
        _drive(policy, hot)
        _drive(policy, hot)  # used twice: frequent
    for i in range(20):  # a one-time scan, twice the size of the cache
        _drive(policy, f"scan{i}")
    return set(policy.residents())


def test_a_one_time_scan_does_not_flush_the_frequent_blocks_from_arc_as_it_does_from_lru() -> None:
    assert {"a", "b"} <= _scan(ARCPolicy)
    assert not {"a", "b"} & _scan(LRUPolicy)


def test_arc_ghost_hits_move_the_target_towards_recency_or_frequency() -> None:
    arc = ARCPolicy(2)
    for x in ("a", "a", "b", "c"):  # a is frequent (T2); c pushes b out of T1 into ghost list B1
        _drive(arc, x)
    assert (list(arc.t1), list(arc.t2), list(arc.b1), arc.p) == (["c"], ["a"], ["b"], 0)
    _drive(arc, "b")  # a miss that B1 remembers: recency would have kept it, so T1's target grows
    assert arc.p == 1 and list(arc.t2) == ["b"] and list(arc.b2) == ["a"]
    _drive(arc, "a")  # a B2 ghost hit: frequency would have kept it, so T1's target shrinks
    assert arc.p == 0 and list(arc.t2) == ["b", "a"] and list(arc.b1) == ["c"] and not arc.t1


def test_full_of_pinned_keys_refuses_without_changing_anything() -> None:
    for cls in (LRUPolicy, ARCPolicy):
        policy = cls(2)
        _drive(policy, 1)
        _drive(policy, 2)
        assert policy.admit(3, lambda k: False) is None
        assert sorted(policy.residents()) == [1, 2] and 3 not in policy


def test_policies_refuse_bad_use() -> None:
    with pytest.raises(KVConnectError, match="unknown eviction policy"):
        make_policy("fifo", 4)
    with pytest.raises(KVConnectError, match="positive"):
        LRUPolicy(0)
    assert isinstance(make_policy("ARC", 3), ARCPolicy)
    lru = LRUPolicy(2)
    lru.admit(1, lambda k: True)
    with pytest.raises(KVConnectError, match="already resident"):
        lru.admit(1, lambda k: True)


def test_reorder_makes_the_first_key_most_recent_without_changing_lists() -> None:
    lru = LRUPolicy(4)
    for k in "abcd":
        _drive(lru, k)
    lru.reorder(["b", "zz", "c"])  # unknown keys are ignored
    assert lru.residents() == ["a", "d", "c", "b"]
    arc = ARCPolicy(4)
    for k in "abca":
        _drive(arc, k)
    arc.reorder(["b", "a", "c"])
    assert (list(arc.t1), list(arc.t2)) == (["c", "b"], ["a"])
