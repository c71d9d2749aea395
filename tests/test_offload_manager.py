"""The scheduler side of the tier: visibility, pins, capacity and eviction, with no bytes involved."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect import KVConnectError
from kvconnect.offload.manager import OffloadManager


def _stored(m: OffloadManager, keys) -> None:
    m.complete_store(m.prepare_store(keys), ok=True)


def test_a_block_is_visible_only_once_its_store_completed() -> None:
    m = OffloadManager(4)
    plan = m.prepare_store(["a", "b"])
    assert list(plan.slots) == [0, 1] and list(plan.positions) == [0, 1]
    assert m.lookup(["a", "b"]) == 0 and m.held() == 2
    with pytest.raises(KVConnectError, match="being stored"):
        m.prepare_load(["a"])
    m.complete_store(plan, ok=True)
    assert m.lookup(["a", "b", "c"]) == 2


def test_a_block_on_its_way_in_is_not_absent_so_a_second_promotion_of_it_is_never_promised() -> None:
    m = OffloadManager(4)
    up = m.prepare_store(["a", "b"], leading=True)  # a promotion in flight
    assert [m.absent(k) for k in "abc"] == [False, False, True]
    assert len(m.prepare_store(["a", "b", "c"], leading=True)) == 0  # what a second request would get
    m.complete_store(up, ok=False, promoted=True)
    assert m.absent("a") and m.absent("b")  # a failed promotion frees its keys for the next request


def test_a_failed_store_publishes_nothing_and_frees_its_slots() -> None:
    m = OffloadManager(3, "arc")
    _stored(m, ["a"])
    plan = m.prepare_store(["a", "b", "c"])
    assert plan.keys == ("b", "c") and plan.already_present == 1
    m.complete_store(plan, ok=False)
    assert m.lookup(["a", "b"]) == 1 and m.held() == 1
    assert "b" not in m.policy and "b" not in m.policy.b1
    s = m.stats()
    assert (s.failed_stores, s.stores, s.in_flight, s.resident) == (1, 1, 0, 1)
    _stored(m, ["b", "c"])  # the freed slots are usable again
    assert m.lookup(["a", "b", "c"]) == 3


def test_lookup_counts_leading_hits_and_unknown_keys_are_misses() -> None:
    m = OffloadManager(8)
    _stored(m, ["a", "b", "d"])
    assert m.lookup([]) == 0
    assert m.lookup(["zz", "a"]) == 0
    assert m.lookup(["a", "b", "c", "d"]) == 2
    assert m.lookup([b"\x00" * 16, 12345, ("t", 1)]) == 0
    s = m.stats()
    assert (s.lookups, s.hits, s.misses) == (4, 2, 2 + 2 + 3)


def test_capacity_is_exact_and_a_request_larger_than_the_tier_keeps_its_prefix() -> None:
    m = OffloadManager(4)
    _stored(m, ["old0", "old1"])
    plan = m.prepare_store([f"k{i}" for i in range(10)])
    # Everything evictable goes; the request's own blocks in flight are not evicted for its tail.
    assert plan.keys == ("k0", "k1", "k2", "k3") and plan.dropped == 6
    m.complete_store(plan, ok=True)
    assert m.held() == 4 and m.lookup([f"k{i}" for i in range(10)]) == 4
    assert m.stats().evictions == 2 and m.stats().dropped == 6


def test_present_blocks_of_the_request_are_not_evicted_for_its_tail() -> None:
    m = OffloadManager(3)
    _stored(m, ["p0", "p1", "x"])
    plan = m.prepare_store(["p0", "p1", "t0", "t1"])
    assert plan.keys == ("t0",) and plan.already_present == 2 and plan.dropped == 1
    m.complete_store(plan, ok=True)
    assert m.lookup(["p0", "p1", "t0"]) == 3 and m.lookup(["x"]) == 0


def test_blocks_being_loaded_or_stored_are_never_evicted() -> None:
    m = OffloadManager(3)
    _stored(m, ["a", "b"])
    load = m.prepare_load(["a"])  # a is pinned by a load in flight
    store = m.prepare_store(["s"])  # s is in flight
    plan = m.prepare_store(["n1", "n2"])  # the only evictable block is b
    assert plan.keys == ("n1",) and plan.dropped == 1 and m.slot_of("b") is None
    assert m.slot_of("a") is not None and m.slot_of("s") is not None
    assert m.prepare_store(["n3"]).keys == ()  # nothing evictable now
    m.complete_load(load, ok=True)
    m.complete_store(store, ok=True)
    m.complete_store(plan, ok=True)
    assert m.prepare_store(["n4"]).keys == ("n4",)


def test_prepare_load_refuses_absent_keys_and_pins_nothing() -> None:
    m = OffloadManager(2)
    _stored(m, ["a"])
    with pytest.raises(KVConnectError, match="position 1 is not in the offload tier \\(absent\\)"):
        m.prepare_load(["a", "b"])
    assert m.pinned() == 0 and m.stats().in_flight == 0


def test_repeated_keys_in_one_store_take_one_slot() -> None:
    m = OffloadManager(4)
    plan = m.prepare_store(["a", "b", "a"])
    assert plan.keys == ("a", "b") and list(plan.positions) == [0, 1]


def test_a_promotion_takes_only_the_leading_run_that_finds_room() -> None:
    m = OffloadManager(4)
    _stored(m, ["x"])
    m.pin(["x"])  # a write-down in progress: not evictable
    plan = m.prepare_store(["a", "b", "x", "c"], leading=True)
    assert plan.keys == ("a", "b")  # stops at a key already held
    m.complete_store(plan, ok=True, promoted=True)
    m.pin(["a", "b"])
    full = m.prepare_store(["d", "e", "f"], leading=True)
    assert full.keys == ("d",) and full.dropped == 0  # stops where room ran out; nothing counted as dropped
    s = m.stats()
    assert (s.promoted, s.stores) == (2, 1)


def test_a_store_published_pinned_stays_until_unpinned() -> None:
    m = OffloadManager(2)
    plan = m.prepare_store(["a", "b"])
    m.complete_store(plan, ok=True, pin=True)
    assert m.pinned() == 2 and m.published(["a", "b", "zz"]).tolist() == [True, True, False]
    assert len(m.prepare_store(["c"])) == 0  # every slot pinned: nothing to evict
    m.unpin(["a", "b"])
    assert m.prepare_store(["c"]).keys == ("c",)
    with pytest.raises(KVConnectError, match="only published"):
        m.pin(["c"])  # in flight, not published


def test_manager_refuses_bad_sizes() -> None:
    with pytest.raises(KVConnectError, match="positive"):
        OffloadManager(0)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.sampled_from(["lru", "arc"]),
       st.lists(st.tuples(st.sampled_from(["store", "fail", "load", "finish"]),
                          st.lists(st.integers(0, 9), min_size=1, max_size=5)), max_size=60))
def test_random_schedules_keep_capacity_pins_and_visibility_consistent(c, policy, ops) -> None:
    m = OffloadManager(c, policy)
    stores, loads = [], []
    for op, keys in ops:
        if op in ("store", "fail"):
            stores.append((m.prepare_store(keys), op == "store"))
        elif op == "load":
            n = m.lookup(keys)
            loads.append(m.prepare_load(keys[:n]))
        elif stores:
            plan, ok = stores.pop(0)
            m.complete_store(plan, ok)
        elif loads:
            m.complete_load(loads.pop(0), ok=True)
        in_flight_keys = {k for plan, _ in stores for k in plan.keys}
        pinned = {k for plan in loads for k in plan.keys}
        assert m.held() <= c and len(m.policy) == m.held()
        slots = [m.slot_of(k) for k in range(10) if m.slot_of(k) is not None]
        assert len(slots) == len(set(slots)) and all(0 <= s < c for s in slots)
        assert all(m.slot_of(k) is not None for k in in_flight_keys | pinned)
        assert not any(m.contains(k) for k in in_flight_keys)
        assert all(m.contains(k) for k in pinned)
        assert m.pinned() == len(pinned)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_prefix_loses_its_tail_first_so_what_stays_is_still_a_hit(policy) -> None:
    m = OffloadManager(4, policy)
    _stored(m, ["a0", "a1", "a2"])
    _stored(m, ["b0", "b1"])  # one eviction: a2, not a0 (which would make a1 and a2 unreachable)
    assert m.lookup(["a0", "a1", "a2"]) == 2 and m.lookup(["b0", "b1"]) == 2
    m.complete_load(m.prepare_load(["b0", "b1"]), ok=True)
    _stored(m, ["c0"])
    assert m.lookup(["a0", "a1"]) == 1  # a1 was the least recent of what was left
