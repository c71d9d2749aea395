"""Byte checks of what a P/D request moved, from the page dumps of kvconnect's vLLM adapter.

`KVCONNECT_DUMP_DIR` makes prefill write the pages it held and decode the pages it loaded
(`kvconnect.integrations.vllm.dump`). A check passes only when every group moved at least one block
(or exactly the blocks the caller expects) and every loaded byte equals the prefill's: a dump with no
blocks, a missing group or a missing rank fails, so a request that moved nothing cannot pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np


def _pages(path: Path) -> dict[str, np.ndarray]:
    assert path.exists(), f"no page dump at {path}: the request was never held or never loaded"
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _expected(params: dict, groups: int) -> list[int] | None:
    """Blocks per group that the prefill handed out, when the params say (pull); None for push."""
    ids = params.get("remote_block_ids")
    if ids is None:
        return None
    per_group = ids if ids and isinstance(ids[0], (list, tuple)) else [ids]
    assert len(per_group) == groups, f"params carry {len(per_group)} groups, expected {groups}"
    return [len(g) for g in per_group]


def assert_pages_moved(held: Path, loaded: Path, params: dict, groups: int,
                       loaded_blocks: Sequence[int] | None = None) -> None:
    """Decode's pages after the load equal prefill's, group, layer and block, and every group moved blocks.

    Decode may already hold a prefix (fewer local blocks): its blocks are then the suffix of the
    prefill's. `loaded_blocks` (per group), when given, is exactly how many blocks decode must have
    loaded; otherwise each group must have loaded at least one.
    """
    rid = params["remote_request_id"]
    before, after = _pages(held / f"held-{rid}.npz"), _pages(loaded / f"loaded-{rid}.npz")
    assert before and sorted(before) == sorted(after), (sorted(before), sorted(after))
    assert len({key.split(":")[0] for key in before}) == groups, sorted(before)
    handed_out = _expected(params, groups)
    for key in before:  # "group:layer"
        g = int(key.split(":")[0])
        want, got = before[key], after[key]
        if handed_out is not None:
            assert want.shape[0] == handed_out[g], f"{key}: prefill held {want.shape[0]} blocks, handed out {handed_out[g]}"
        need = loaded_blocks[g] if loaded_blocks is not None else None
        assert (got.shape[0] == need) if need is not None else got.shape[0] >= 1, \
            f"{key}: decode loaded {got.shape[0]} blocks, expected {need if need is not None else 'at least 1'}"
        assert got.shape[0] <= want.shape[0] and np.array_equal(got, want[want.shape[0] - got.shape[0]:]), key


def assert_tp_pages(prefill_dir: Path, p_tp: int, decode_dir: Path, d_tp: int, rid: str) -> None:
    """Decode's pages after the load are the head shards prefill held, rearranged for decode's TP size;
    every rank's dump has every layer and at least one block."""
    def name(kind: str, tp: int, r: int) -> str:
        return f"{kind}-{rid}" + (f"-rank{r}" if tp > 1 else "") + ".npz"

    held = [_pages(prefill_dir / name("held", p_tp, r)) for r in range(p_tp)]
    loaded = [_pages(decode_dir / name("loaded", d_tp, r)) for r in range(d_tp)]
    keys = sorted(held[0])
    assert keys, f"{rid}: prefill dumped no layers"
    for pages in held + loaded:
        assert sorted(pages) == keys, (sorted(pages), keys)
    for key in keys:
        # Heads are the outermost dim of a page: the whole page is the ranks' pages side by side.
        whole = np.concatenate([h[key] for h in held], axis=1)
        got = np.concatenate([ld[key] for ld in loaded], axis=1)
        assert 1 <= got.shape[0] <= whole.shape[0], f"{rid} {key}: decode loaded {got.shape[0]} blocks"
        assert np.array_equal(got, whole[whole.shape[0] - got.shape[0]:]), f"{rid} {key}: bytes differ"


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba2 layer's state, model-wide: what vLLM cuts per rank (x by head, B/C by group, SSM by head)."""

    heads: int
    head_dim: int
    d_state: int
    groups: int
    taps: int
    value_bytes: int = 4  # float32 states (the e2e models are float32)

    def whole(self, pages: list[np.ndarray], tp: int, check_replicas: bool = False) -> np.ndarray:
        """The state content of TP 1 (padding dropped), put together from every rank's `(blocks, bytes)` pages
        of `tp` ranks, as vLLM shards it; `check_replicas`: every rank's replicated B/C equals rank 0's."""
        heads, vb = self.heads // tp, self.value_bytes
        bc = max(self.groups // tp, 1) * self.d_state
        x, channels = heads * self.head_dim, heads * self.head_dim + 2 * bc
        conv_n, ssm_n = self.taps * channels * vb, heads * self.head_dim * self.d_state * vb
        convs = [p[:, :conv_n].reshape(p.shape[0], self.taps, channels, vb) for p in pages]
        ssms = [p[:, conv_n:conv_n + ssm_n] for p in pages]
        if self.groups < tp:  # each rank holds the one group whole: take it once
            b, c = convs[0][:, :, x:x + bc], convs[0][:, :, x + bc:]
            if check_replicas:
                for r, conv in enumerate(convs[1:], 1):
                    assert np.array_equal(conv[:, :, x:], convs[0][:, :, x:]), f"rank {r}'s B/C differ from rank 0's"
        else:
            b = np.concatenate([cv[:, :, x:x + bc] for cv in convs], axis=2)
            c = np.concatenate([cv[:, :, x + bc:] for cv in convs], axis=2)
        conv = np.concatenate([np.concatenate([cv[:, :, :x] for cv in convs], axis=2), b, c], axis=2)
        return np.concatenate([conv.reshape(conv.shape[0], -1), np.concatenate(ssms, axis=1)], axis=1)


def assert_tp_hybrid_pages(prefill_dir: Path, p_tp: int, decode_dir: Path, d_tp: int, rid: str, groups: int,
                           mamba: Mamba2Dims, is_state: Callable[[str], bool]) -> None:
    """Decode's pages after the load hold what prefill's ranks held, put together as a TP-1 engine holds
    them, per group and layer: attention pages by head (heads outermost), Mamba2 states as `mamba` says;
    every group moved at least one block."""
    def name(kind: str, tp: int, r: int) -> str:
        return f"{kind}-{rid}" + (f"-rank{r}" if tp > 1 else "") + ".npz"

    held = [_pages(prefill_dir / name("held", p_tp, r)) for r in range(p_tp)]
    loaded = [_pages(decode_dir / name("loaded", d_tp, r)) for r in range(d_tp)]
    keys = sorted(held[0])
    assert len({key.split(":")[0] for key in keys}) == groups, keys
    assert any(is_state(k) for k in keys) and not all(is_state(k) for k in keys), f"{rid}: no state or no attention layer: {keys}"
    for pages in held + loaded:
        assert sorted(pages) == keys, (sorted(pages), keys)
    for key in keys:
        if is_state(key):
            whole = mamba.whole([h[key] for h in held], p_tp)
            got = mamba.whole([ld[key] for ld in loaded], d_tp, check_replicas=True)
        else:
            whole = np.concatenate([h[key] for h in held], axis=1)
            got = np.concatenate([ld[key] for ld in loaded], axis=1)
        assert 1 <= got.shape[0] <= whole.shape[0], f"{rid} {key}: decode loaded {got.shape[0]} blocks"
        assert np.array_equal(got, whole[whole.shape[0] - got.shape[0]:]), f"{rid} {key}: bytes differ"


def dumped_by_rank(directory: Path, kind: str, rank: int) -> dict[str, dict[str, np.ndarray]]:
    """Per block key (hex), the pages one TP rank dumped as `kind` ("stored" or "loaded"), per layer."""
    out = {}
    for path in directory.glob(f"{kind}-*-rank{rank}.npz"):
        with np.load(path) as pages:
            out[path.name[len(kind) + 1:-len(f"-rank{rank}.npz")]] = {k: pages[k] for k in pages.files}
    return out


def state_hit_keys(prompts: Sequence[Sequence[int]], block: int) -> tuple[set[str], set[str]]:
    """The keys (hex) that offload hits of `prompts` (each to its last whole block before the last
    token) load on a model of one attention and one state group: every block of the attention group
    and the last block of the state group; one set per order vLLM may give the two groups."""
    from kvconnect.offload.keys import block_keys, group_keys

    every, last = [set(), set()], [set(), set()]
    for prompt in prompts:
        h = (len(prompt) - 1) // block
        for g, ks in enumerate(group_keys(block_keys(list(prompt), block), 2)):
            every[g].update(ks[:h])
            last[g].add(ks[h - 1])
    return {k.hex() for k in every[0] | last[1]}, {k.hex() for k in last[0] | every[1]}
