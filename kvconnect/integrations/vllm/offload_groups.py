"""KVConnectOffload for models with several KV-cache groups: keys, hits and block lists per group.

vLLM gives every group its own block table, and the groups' layers share the cache tensors, so one
block id of one group holds that group's pages in every tensor. The host pool therefore keeps one
*group block* per slot (one block of every registered tensor) under a key of its own: the group's
index folded into the token block's key. Group 0's keys are the plain token-block keys, so a model
with one group keys its pages as before.

A prefix hit of `h` blocks from `start` needs, for each full-attention group, every block of
`[start, start + h)`, and for a sliding-window group of `w` tokens only the blocks holding the
`w - 1` tokens before `(start + h) * block_size`, the ones the next token attends to (vLLM's own
prefix cache asks the same); vLLM gives the others its null block, which is neither stored nor
loaded. A block vLLM allocated whose group key the tier does not hold is reported as a load error,
so vLLM recomputes it rather than reading a block nobody wrote. Lower tiers keep group blocks under
the same keys, so a hit may take some from the host pool and bring the others up.

A group that keeps one state for the whole sequence (short conv, GDN) holds a usable page only at
the block boundaries vLLM checkpoints: the state after `(i + 1) * block_size` tokens, in block `i`
of its table, keyed like that token block. A hit of `h` blocks needs that group's page of block
`h - 1` alone, and vLLM allocates exactly that one block of the group for it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kvconnect.integrations.vllm.groups import GroupRule

# vLLM's null block (the first block of its pool): what a sliding-window group has outside its window.
NULL_BLOCK = 0


def hit_blocks(present: Sequence[np.ndarray], rules: Sequence[GroupRule], start: int) -> int:
    """The longest prefix hit: `present[g][i]` says whether group g's page of block `start + i` is held."""
    n = min(p.size for p in present)
    run = n
    for p, rule in zip(present, rules):
        if not rule.window_tokens and not rule.whole_sequence_state:
            miss = np.flatnonzero(~p[:n])
            run = min(run, int(miss[0]) if miss.size else n)
    ok = np.ones(run + 1, dtype=bool)
    h = np.arange(run + 1)
    for p, rule in zip(present, rules):
        if rule.whole_sequence_state:
            ok[1:] &= p[:run]  # the state after h blocks is the page of block h - 1; none is needed for h = 0
        elif rule.window_tokens:
            absent = np.concatenate([[0], np.cumsum(~p[:run])])
            # The first block the window ending at block start + h reaches into, counted from start.
            lo = np.maximum(0, ((start + h) * rule.block_size - (rule.window_tokens - 1)) // rule.block_size - start)
            ok &= absent[h] == absent[np.minimum(lo, h)]
    return int(np.flatnonzero(ok)[-1])


def group_blocks(keys: Sequence[Sequence[bytes]], block_ids: Sequence[Sequence[int]], start: int, count: int,
                 held: Callable[[bytes], bool]) -> tuple[list[bytes], np.ndarray, np.ndarray, list[int]]:
    """For the blocks `[start, start + count)` of every group: (keys held, their block ids, block ids not
    held, how many of the keys held are each group's).

    `block_ids[g]` are group g's ids from position 0; null blocks are skipped.
    """
    want_keys: list[bytes] = []
    want_ids, missing, per_group = [], [], []
    for ks, ids in zip(keys, block_ids):
        ids = np.asarray(ids[start:start + count], dtype=np.int64)
        real = np.flatnonzero(ids != NULL_BLOCK)
        have = np.fromiter((held(ks[start + i]) for i in real), dtype=bool, count=real.size)
        want_keys.extend(ks[start + i] for i in real[have])
        want_ids.append(ids[real[have]])
        missing.append(ids[real[~have]])
        per_group.append(int(have.sum()))
    return want_keys, np.concatenate(want_ids or [np.zeros(0, np.int64)]), np.concatenate(
        missing or [np.zeros(0, np.int64)]), per_group


def state_block_ok(block_ids: Sequence[int], start: int, count: int) -> bool:
    """Whether a state group's blocks `[start, start + count)` are what a hit of `start + count` blocks
    loads into: vLLM's null block everywhere but the last, which is a real block."""
    ids = np.asarray(block_ids[start:start + count], dtype=np.int64)
    return ids.size == count > 0 and ids[-1] != NULL_BLOCK and not (ids[:-1] != NULL_BLOCK).any()


def stored_blocks(keys: Sequence[Sequence[bytes]], block_ids: Sequence[Sequence[int]],
                  skip: Sequence[bool] = ()) -> tuple[list[bytes], np.ndarray]:
    """A finished request's group blocks worth storing: every full block that is not vLLM's null block, in
    the groups not `skip`ped (a state group's running block is no boundary state: it is stored when offered)."""
    out_keys: list[bytes] = []
    out_ids = []
    for g, (ks, ids) in enumerate(zip(keys, block_ids)):
        if g < len(skip) and skip[g]:
            continue
        n = min(len(ks), len(ids))
        ids = np.asarray(ids[:n], dtype=np.int64)
        real = np.flatnonzero(ids != NULL_BLOCK)
        out_keys.extend(ks[i] for i in real)
        out_ids.append(ids[real])
    return out_keys, np.concatenate(out_ids or [np.zeros(0, np.int64)])
