"""The data mover on its own: slot runs, bounded GPU waits, and copies against a block-by-block reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect import TransferError
from kvconnect.offload.mover import BlockMover, slot_runs, wait_event
from kvconnect.regions import RegionSet


def _b(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes: rows are wide words (complex128 here), and random bytes include NaNs."""
    return t.contiguous().view(torch.uint8)


def test_slot_runs_split_where_slots_stop_being_consecutive() -> None:
    pos, first, count = slot_runs(np.array([4, 5, 6, 0, 9, 10]))
    assert pos.tolist() == [0, 3, 4] and first.tolist() == [4, 0, 9] and count.tolist() == [3, 1, 2]
    assert [a.size for a in slot_runs(np.empty(0, dtype=np.int64))] == [0, 0, 0]


class _NeverDone:
    def query(self) -> bool:
        return False


class _DoneAfter:
    def __init__(self, n: int):
        self.n = n

    def query(self) -> bool:
        self.n -= 1
        return self.n < 0


def test_waiting_for_a_gpu_event_is_bounded() -> None:
    with pytest.raises(TransferError, match="offload store did not complete on the GPU within 0.02 s"):
        wait_event(_NeverDone(), 0.02, "offload store")
    wait_event(_DoneAfter(3), 5.0, "offload load")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**31), st.sampled_from([0, 2, 8, 100]))
def test_copies_match_a_block_by_block_reference_for_any_slot_pattern(n, seed, max_runs) -> None:
    rng = np.random.default_rng(seed)
    blocks, slots = 48, 64
    caches = {"a": torch.from_numpy(rng.integers(0, 256, (blocks, 96), dtype=np.uint8)),
              "b": torch.from_numpy(rng.integers(0, 256, (blocks, 3, 5), dtype=np.uint8))}
    mover = BlockMover(caches, RegionSet.from_kv_caches(caches), slots)
    mover.max_runs, mover.stage_bytes = max_runs, int(rng.integers(1, 2000))
    ids = rng.integers(0, blocks, n)
    # Mostly runs with some jumps, as a pool that has seen evictions hands them out.
    where = np.sort(rng.choice(slots, n, replace=False)) if rng.random() < 0.5 else rng.permutation(slots)[:n]
    mover.store(ids, where)
    for rows, pool in zip(mover.rows, mover.pool):
        for i, s in zip(ids, where):
            assert torch.equal(_b(pool[s]), _b(rows[i]))
    dst = rng.permutation(blocks)[:n]
    want = [rows.clone() for rows in mover.rows]
    for w, pool in zip(want, mover.pool):
        for d, s in zip(dst, where):
            w[d] = pool[s]
    mover.load(where, dst)
    for rows, w in zip(mover.rows, want):
        assert torch.equal(_b(rows), _b(w))
