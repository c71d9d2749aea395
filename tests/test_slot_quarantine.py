"""Slots that a lower tier's abandoned read may still write get no other page until that read returns.

The store tier's gets of long rows land in their pool slots; one abandoned at its deadline holds its
slots in the pool's quarantine (proved against a stalled Mooncake storage node in
`test_tier_faults`). Here: every other writer of pool slots honours the hold. The mover's store
into a held slot is dropped at once, and a fetch asks no later tier (a real disk tier) for a held
slot. The abandoning tier is a fault-injection double; the disk tier and mover are real.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
import torch

from kvconnect.errors import TransferError
from kvconnect.offload.mover import BlockMover
from kvconnect.offload.quarantine import SlotQuarantine
from kvconnect.offload.tiers import PoolView, Tier
from kvconnect.offload.tiers.chain import TierChain
from kvconnect.offload.tiers.disk import DiskTier
from kvconnect.regions import RegionSet

pytestmark = pytest.mark.timeout(120)


class AbandoningTier(Tier):
    """Claims every page; its first get gives up as at a deadline and keeps the slots held, as a
    Mooncake call still in flight does, until `returns()`; later gets find nothing."""

    name = "abandoning"

    def __init__(self) -> None:
        super().__init__()
        self.held: np.ndarray | None = None

    def attach(self, pool: PoolView) -> None:
        self.pool = pool

    def put(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        return np.ones(len(keys), dtype=bool)

    def get(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        if self.held is None:
            self.held = np.array(slots, dtype=np.int64)
            self.pool.quarantine.hold(self.held)
        return np.zeros(len(keys), dtype=bool)

    def returns(self) -> None:
        """The abandoned call writes its slots late, then returns."""
        for rows in self.pool.rows:
            rows[self.held] = 0xEE
        self.pool.quarantine.release(self.held)

    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        return np.ones(len(keys), dtype=bool)


def _mover(slots: int = 8) -> tuple[dict[str, torch.Tensor], BlockMover]:
    caches = {f"l{i}": torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64) + 1000 * i for i in range(2)}
    return caches, BlockMover(caches, RegionSet.from_kv_caches(caches), slots)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A pool's or cache's rows as bytes."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def test_holds_are_counted_and_a_release_of_a_slot_not_held_is_refused():
    q = SlotQuarantine(4)
    q.hold(np.array([1, 1, 2]))
    q.release(np.array([1, 2]))
    assert q.held(np.arange(4)).tolist() == [False, True, False, False] and q.count == 1
    with pytest.raises(ValueError, match="not held"):
        q.release(np.array([3]))
    q.release(np.array([1]))
    assert q.count == 0 and not q.held(np.arange(4)).any()


def test_a_store_into_held_slots_is_dropped_at_once_and_leaves_them_alone():
    caches, mover = _mover()
    mover.quarantine.hold(np.array([2, 3]))
    # At once: the vLLM worker stores on the engine's step, which must not wait on a stalled store.
    with pytest.raises(TransferError, match="abandoned"):
        mover.store(np.array([0, 1]), np.array([2, 3]), timeout=30)
    assert all((p[2:4] == 0).all() for p in mover.pool), "a store wrote slots an abandoned read may still write"
    mover.store(np.array([4, 5]), np.array([4, 5]))  # other slots are not held up
    assert all(torch.equal(_rows(p)[4:6], _rows(c)[4:6]) for p, c in zip(mover.pool, caches.values()))

    mover.quarantine.release(np.array([2, 3]))  # the abandoned read returned
    mover.store(np.array([0, 1]), np.array([2, 3]))
    assert all(torch.equal(_rows(p)[2:4], _rows(c)[0:2]) for p, c in zip(mover.pool, caches.values()))


def test_a_fetch_asks_no_later_tier_for_a_slot_an_abandoned_read_may_write(tmp_path):
    caches, mover = _mover()
    view = PoolView(tuple(p.view(torch.uint8).numpy() for p in mover.pool), mover.quarantine)
    keys = [bytes([k]) * 16 for k in range(4)]
    mover.store(np.arange(4), np.arange(4))
    disk = DiskTier(tmp_path, 1 << 20)
    disk.attach(view)
    assert disk.put(keys, np.arange(4)).all()
    stored = view.gather(np.arange(4))

    first = AbandoningTier()
    chain = TierChain([first, disk], view)
    assert not chain.fetch(keys, np.arange(4, 8)).any()
    assert view.quarantine.held(np.arange(4, 8)).all()
    assert disk.stats().loaded == 0 and disk.stats().missed == 0, "the disk tier was asked for held slots"
    assert chain.fetch(keys[:2], np.array([0, 1])).all()  # slots not held are served as before

    first.returns()
    got = chain.fetch(keys, np.arange(4, 8))
    assert got.all() and (view.gather(np.arange(4, 8)) == stored).all()
    chain.close(5)
