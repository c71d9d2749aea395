"""P/D between engines of different tensor-parallel sizes, on real NIXL and real Mooncake.

Each producer rank is its own process (tests/pd_peer.py) holding its shard of one model-wide cache
(tests/tp_caches.py); each decode rank is a connector in this process with a zeroed cache. After
the pull, every decode rank's blocks must equal its own shard of the producer's bytes, byte for
byte, and every producer rank must have released the request (all its readers said done, or a decode
rank released a rank nobody reads).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from conftest import PRODUCER_SEED, wait_for
from kvconnect import KVConnectError
from kvconnect.connector import ConnectorConfig, KVConnector
from kvconnect.pd.producer import combine_ranks
from kvconnect.shards import page_slices, rank_plan, replicated
from tp_caches import tp_caches

NUM_BLOCKS = 64
REMOTE = [[5, 6, 7, 20, 33, 34, 60]]
LOCAL = [[40, 41, 2, 3, 4, 10, 63]]
# tp-shared: its attention group reads blocks of even id, its Mamba2 group blocks of odd id, of one region.
SHARED_REMOTE = [[6, 20, 34, 60], [5, 7, 33]]
SHARED_LOCAL = [[40, 2, 4, 10], [41, 3, 63]]

# (prefill TP, decode TP, kind): head splits both ways, identity, KV heads fewer than the TP size on
# either side, a replicated latent, and a hybrid page whose Mamba-like states split by channel and head.
CASES = [(2, 1, "tp-hnd-4"), (1, 2, "tp-hnd-4"), (2, 2, "tp-hnd-8"), (2, 1, "tp-nhd-8"), (1, 2, "tp-nhd-8"),
         (4, 2, "tp-hnd-2"), (1, 4, "tp-hnd-2"), (2, 1, "tp-mla"), (1, 2, "tp-mla"), (2, 1, "tp-hybrid"),
         (1, 2, "tp-hybrid"), (2, 1, "tp-shared"), (1, 2, "tp-shared"), (2, 1, "tp-aux"), (1, 2, "tp-aux")]
# Mooncake runs the same code paths above the transport: a cross-section of the cases.
MOONCAKE_CASES = [(2, 1, "tp-hnd-4"), (1, 2, "tp-nhd-8"), (2, 1, "tp-mla"), (1, 2, "tp-hybrid"), (2, 1, "tp-shared"),
                  (2, 1, "tp-aux")]
# tp-aux: the request's attention pages, and one row of a group every rank holds whole.
AUX_REMOTE, AUX_LOCAL = [REMOTE[0], [9]], [LOCAL[0], [11]]


def _groups(kind: str) -> list[list[int]]:
    if kind == "tp-aux":
        return AUX_LOCAL
    return SHARED_LOCAL if kind == "tp-shared" else [LOCAL[0]] * (2 if kind == "tp-hybrid" else 1)


def _remote(kind: str) -> list[list[int]]:
    if kind == "tp-aux":
        return AUX_REMOTE
    return SHARED_REMOTE if kind == "tp-shared" else [REMOTE[0]] * (2 if kind == "tp-hybrid" else 1)


def _flat(groups: list[list[int]]) -> list[int]:
    return [i for g in groups for i in g]


def start_producer_ranks(producers, kind: str, tp: int, **kw):
    """One producer process per TP rank of one engine."""
    return [producers(kind, NUM_BLOCKS, PRODUCER_SEED, engine_id="prefill-tp", rank=r, world_size=tp, **kw)
            for r in range(tp)]


def hold_everywhere(ranks, request_id: str, kind: str) -> dict:
    """Every producer rank holds the request; their params combined into one (as a scheduler would)."""
    from kvconnect import wire

    per_rank = [wire.transfer_params_from_builtins(p.hold(request_id, _remote(kind), 100)) for p in ranks]
    return wire.transfer_params_to_builtins(combine_ranks(per_rank))


def decode_ranks(backend: str, kind: str, tp: int, made: list, push: bool = False) -> list[tuple[KVConnector, dict]]:
    """Decode ranks in this process, caches zeroed (`push`: offering their blocks in push mode)."""
    out = []
    for r in range(tp):
        caches, groups, shards = tp_caches(kind, NUM_BLOCKS, seed=0, tp=tp, rank=r)
        for t in caches.values():
            t.zero_()
        conn = KVConnector(ConnectorConfig(role="consumer", backend=backend, engine_id="decode-tp", rank=r,
                                           world_size=tp, groups=groups, shards=shards, push=push))
        conn.register_kv_caches(caches)
        made.append(conn)
        out.append((conn, caches))
    return out


@pytest.fixture
def made(made_connectors):
    return made_connectors


def _pages(caches: dict[str, torch.Tensor], ids: list[int]) -> dict[str, np.ndarray]:
    return {name: t.view(torch.uint8).reshape(t.shape[0], -1)[ids].numpy() for name, t in caches.items()}


def assert_shard_landed(caches: dict[str, torch.Tensor], kind: str, d_tp: int, r: int, how: str) -> None:
    """Decode rank `r` of `d_tp` holds its shard of the prefill's pages at LOCAL, and no other block was written."""
    theirs, groups, _ = tp_caches(kind, NUM_BLOCKS, PRODUCER_SEED, tp=d_tp, rank=r)
    if kind == "tp-aux":  # groups of their own tensors: each tensor compared at its group's blocks
        per_name = {name: (lg, rg) for g, lg, rg in zip(groups, _groups(kind), _remote(kind)) for name in g.layers}
    else:  # every tensor holds the blocks of every group
        per_name = {name: (_flat(_groups(kind)), _flat(_remote(kind))) for name in caches}
    for name, (local, remote) in per_name.items():
        got, want = _pages({name: caches[name]}, local)[name], _pages({name: theirs[name]}, remote)[name]
        assert np.array_equal(got, want), f"decode rank {r} of {d_tp}, {name}: bytes differ"
        untouched = sorted(set(range(NUM_BLOCKS)) - set(local))
        assert not _pages({name: caches[name]}, untouched)[name].any(), f"a block of {name} not {how} was written"


def _run(backend, producers, made, p_tp, d_tp, kind):
    ranks = start_producer_ranks(producers, kind, p_tp)
    params = hold_everywhere(ranks, "req-tp", kind)
    decoders = decode_ranks(backend, kind, d_tp, made)
    for r, (conn, _) in enumerate(decoders):
        conn.start_load(params, _groups(kind), handle=f"load-{r}")
    for r, (conn, caches) in enumerate(decoders):
        fin = wait_for(conn, [f"load-{r}"])
        assert fin.loaded == [f"load-{r}"], fin.failed
        assert_shard_landed(caches, kind, d_tp, r, "loaded")
    for p in ranks:
        assert p.held_blocks() == 0, "a producer rank still holds the request after every decode rank loaded it"


@pytest.mark.parametrize("p_tp,d_tp,kind", CASES, ids=[f"{k}-P{p}-D{d}" for p, d, k in CASES])
def test_a_decode_rank_holds_its_shard_of_every_prefill_rank_bytes_over_nixl(producer_processes, made, p_tp, d_tp,
                                                                            kind):
    producers = lambda *a, **kw: producer_processes(*a, backend="nixl", **kw)  # noqa: E731
    _run("nixl", producers, made, p_tp, d_tp, kind)


@pytest.mark.parametrize("p_tp,d_tp,kind", MOONCAKE_CASES, ids=[f"{k}-P{p}-D{d}" for p, d, k in MOONCAKE_CASES])
def test_a_decode_rank_holds_its_shard_of_every_prefill_rank_bytes_over_mooncake(producer_processes, made, p_tp,
                                                                                d_tp, kind):
    producers = lambda *a, **kw: producer_processes(*a, backend="mooncake", **kw)  # noqa: E731
    _run("mooncake", producers, made, p_tp, d_tp, kind)


def test_pages_without_a_split_are_refused_between_tp_sizes_naming_both(producer_processes, made):
    ranks = start_producer_ranks(lambda *a, **kw: producer_processes(*a, backend="nixl", **kw), "tp-plain-4", 2,
                                 lease_s=2.0)
    params = hold_everywhere(ranks, "req-plain", "tp-plain-4")
    (conn, _), = decode_ranks("nixl", "tp-plain-4", 1, made)
    with pytest.raises(KVConnectError, match="cannot map prefill TP 2 onto decode TP 1"):
        conn.start_load(params, [LOCAL[0]])
    for p in ranks:  # nothing claimed them: the leases end by expiry
        assert p.held_blocks(wait_s=15.0) == 0


def test_a_peer_with_other_head_counts_fails_the_handshake(producer_processes, made):
    ranks = start_producer_ranks(lambda *a, **kw: producer_processes(*a, backend="nixl", **kw), "tp-hnd-4", 2)
    params = hold_everywhere(ranks, "req-heads", "tp-hnd-4")
    (conn, _), = decode_ranks("nixl", "tp-hnd-8", 1, made)
    conn.start_load(params, [LOCAL[0]], handle="h")
    fin = wait_for(conn, ["h"])
    assert "h" in fin.failed and fin.failed["h"].stage == "handshake", fin
    assert "page bytes" in fin.failed["h"].reason
    assert fin.invalid_block_ids == set(LOCAL[0])
    for p in ranks:  # every part aborted: each rank's lease ends at once
        assert p.held_blocks(wait_s=15.0) == 0


def test_a_dead_prefill_rank_fails_the_load_within_its_deadline_and_frees_the_other_rank(producer_processes, made):
    ranks = start_producer_ranks(lambda *a, **kw: producer_processes(*a, backend="nixl", **kw), "tp-hnd-4", 2)
    params = hold_everywhere(ranks, "req-dead", "tp-hnd-4")
    ranks[1].kill()
    (conn, _), = decode_ranks("nixl", "tp-hnd-4", 1, made)
    conn.consumer.handshake_timeout_s = 2.0
    t0 = time.monotonic()
    conn.start_load(params, [LOCAL[0]], handle="h", timeout_s=10.0)
    fin = wait_for(conn, ["h"], timeout=20.0)
    assert "h" in fin.failed, fin
    assert time.monotonic() - t0 < 10.0 + 5.0  # the load deadline, with room for a loaded host
    assert ranks[0].held_blocks(wait_s=15.0) == 0, "the live rank kept the request after the load failed"


def test_a_stalled_prefill_rank_fails_only_its_load_within_the_deadline_and_leaks_nothing(producer_processes, made):
    from kvconnect import wire
    from kvconnect.faults import stalled

    nixl = lambda *a, **kw: producer_processes(*a, backend="nixl", **kw)  # noqa: E731
    ranks = start_producer_ranks(nixl, "tp-hnd-4", 2, lease_s=5.0)
    other = nixl("tp-hnd-4", NUM_BLOCKS, PRODUCER_SEED, engine_id="prefill-other")  # a healthy TP-1 prefill
    stuck = hold_everywhere(ranks, "req-stuck", "tp-hnd-4")
    fine = other.hold("req-fine", REMOTE, 100)
    (conn, caches), = decode_ranks("nixl", "tp-hnd-4", 1, made)
    elsewhere = [50, 51, 52, 53, 54, 55, 56]
    with stalled(ranks[1].pid):
        t0 = time.monotonic()
        conn.start_load(stuck, [LOCAL[0]], handle="stuck", timeout_s=4.0)  # queued first
        conn.start_load(fine, [elsewhere], handle="fine")
        assert wait_for(conn, ["fine"]).loaded == ["fine"], "a healthy prefill's load waited for a stalled rank"
        got = _pages(caches, elsewhere)
        want = _pages(tp_caches("tp-hnd-4", NUM_BLOCKS, PRODUCER_SEED, tp=1)[0], REMOTE[0])
        assert all(np.array_equal(got[name], want[name]) for name in want)
        fin = wait_for(conn, ["stuck"], timeout=4.0 + 5.0 + 5.0)
        assert "stuck" in fin.failed and time.monotonic() - t0 < 4.0 + 5.0, fin
        assert fin.invalid_block_ids == set(LOCAL[0])
    assert wire.checked_params(stuck).tp_size == 2
    for p in (*ranks, other):  # resumed: the stalled rank's lease expires, the others were released
        assert p.held_blocks(wait_s=15.0) == 0


# ---- the mapping itself, without processes ----

def test_rank_plan_counts_the_readers_of_every_prefill_rank_and_releases_unread_ones():
    hnd = tp_caches("tp-hnd-4", 4, 0, tp=1)[2]["layers.0.attn"]
    assert rank_plan([hnd], 1, 0, 2).reads == (0, 1)
    assert rank_plan([hnd], 2, 1, 1).readers == (2,)
    mla = replicated(1024)
    plan0, plan1 = rank_plan([mla], 1, 0, 2), rank_plan([mla], 2, 1, 4)
    assert (plan0.reads, plan0.readers, plan0.releases) == ((0,), (1, 0), (1,))
    assert (plan1.reads, plan1.readers, plan1.releases) == ((1,), (1, 1, 0, 0), (3,))


def test_a_head_split_is_one_range_per_block_for_heads_outer_pages_and_per_token_otherwise():
    whole = tp_caches("tp-hnd-4", 4, 0, tp=1)[2]["layers.0.attn"]
    half = tp_caches("tp-hnd-4", 4, 0, tp=2, rank=1)[2]["layers.0.attn"]
    lo, ro, ln = page_slices(whole, 1, 0, half, 2, 1)
    assert (lo.tolist(), ro.tolist(), ln.tolist()) == ([2 * 16 * 128], [0], [2 * 16 * 128])
    whole_nhd = tp_caches("tp-nhd-4", 4, 0, tp=1)[2]["layers.0.attn"]
    half_nhd = tp_caches("tp-nhd-4", 4, 0, tp=2, rank=0)[2]["layers.0.attn"]
    lo, ro, ln = page_slices(whole_nhd, 1, 0, half_nhd, 2, 0)
    assert lo.size == 16 and set(ln.tolist()) == {2 * 128}
    assert lo.tolist() == [t * 4 * 128 for t in range(16)] and ro.tolist() == [t * 2 * 128 for t in range(16)]


def test_a_lease_read_by_two_decode_ranks_ends_only_when_both_are_done():
    from kvconnect.pd.leases import LeaseTable, ReleaseReason

    now = [0.0]
    table = LeaseTable(lease_s=30.0, clock=lambda: now[0])
    table.hold("r", [[1, 2]], 32)
    table.claim(["r"], 10.0, readers=2)
    assert table.release("r", ReleaseReason.DONE, reader=("decode", 0), readers=2)
    assert table.held_blocks == 2 and not table.drain_released(), "released while rank 1 may still be reading"
    assert table.release("r", ReleaseReason.DONE, reader=("decode", 0), readers=2)  # the same rank again
    assert table.held_blocks == 2
    assert table.release("r", ReleaseReason.ABORTED, reader=("decode", 1), readers=2)
    (released,) = table.drain_released()
    assert released.reason is ReleaseReason.ABORTED and table.held_blocks == 0
    table.hold("s", [[3]], 16)
    table.claim(["s"], 5.0, readers=2)
    table.release("s", ReleaseReason.DONE, reader=("decode", 0), readers=2)
    now[0] = 31.0  # the second reader never came: the lease still ends, by expiry
    assert [r.reason for r in table.drain_released()] == [ReleaseReason.EXPIRED]


def test_layers_merged_into_one_cross_layer_region_keep_each_layers_split_at_its_offset():
    from kvconnect.regions import RegionSet
    from kvconnect.shards import Segment, attention

    # Blocks outermost: each block holds layer 0's page then layer 1's ([2 heads, 16 tokens, 128 B] each).
    buf = torch.zeros(8, 2, 2, 16, 128, dtype=torch.uint8)
    caches = {"l0": buf[:, 0], "l1": buf[:, 1]}
    split = attention(16, 2, 128, 4, heads_outer=True)
    rs = RegionSet.from_kv_caches(caches, layer_groups=[("l0", "l1")], shards={"l0": split, "l1": split})
    (region,) = rs.regions
    assert region.block_bytes == 2 * 2 * 16 * 128
    assert region.shards == (Segment(0, 1, 0, 16 * 128, 4), Segment(2 * 16 * 128, 1, 0, 16 * 128, 4))
    whole = attention(16, 4, 128, 4, heads_outer=True)
    lo, ro, ln = page_slices(region.shards, 2, 1, (whole[0], Segment(4 * 16 * 128, 1, 0, 16 * 128, 4)), 1, 0)
    # Decode rank 1 of 2 reads heads 2 and 3 of each layer from the whole pages of prefill's one rank.
    assert (lo.tolist(), ro.tolist(), ln.tolist()) == ([0, 4096], [4096, 12288], [4096, 4096])


def test_a_region_its_groups_split_differently_carries_a_split_per_group_across_the_wire():
    from kvconnect.regions import RegionSet
    from kvconnect.shards import attention, mamba2_state

    # One tensor viewed by an attention layer (group 0) and a Mamba2 layer (group 1), as vLLM lays a hybrid.
    raw = torch.zeros(8, 2 * 16 * 128, dtype=torch.uint8)
    caches = {"attn": raw.view(8, 2, 16, 128), "mamba": raw.view(torch.int8).view(8, 1, 1, -1)}
    heads, state = attention(16, 2, 128, 4, heads_outer=True), mamba2_state(4, 8, 4, 1, 3, 2, 4, tp=2)
    rs = RegionSet.from_kv_caches(caches, layer_groups=[("attn",), ("mamba",)],
                                  shards={"attn": heads, "mamba": state})
    (region,) = rs.regions
    assert region.shards is None and region.group_shards == ((0, heads), (1, state))
    assert (region.split(0), region.split(1), region.splits) == (heads, state, (heads, state))
    assert RegionSet.from_wire(rs.to_wire())[0].group_shards == region.group_shards
    # One group without a split leaves that group unmapped (refused between TP sizes), the other mapped.
    half = RegionSet.from_kv_caches(caches, layer_groups=[("attn",), ("mamba",)], shards={"attn": heads})
    assert half[0].group_shards == ((0, heads), (1, None))
    # Groups that agree keep one split for the region.
    same = RegionSet.from_kv_caches(caches, layer_groups=[("attn",), ("mamba",)], shards={"attn": heads, "mamba": heads})
    assert same[0].shards == heads and same[0].group_shards == ()
