"""Push mode between instances of different tensor-parallel sizes, on real NIXL and real Mooncake.

Each prefill rank is its own `pd_peer` process with push on (rank r listening at base port + r) holding
its shard of one model-wide cache (tests/tp_caches.py); each decode rank is a connector in this
process with a zeroed cache, offering its blocks to every prefill rank. After the push, every decode
rank's blocks must equal its own shard of the prefill's bytes, byte for byte, blocks no push names
must stay zero, and nothing may be held on either side.
"""

from __future__ import annotations

import time

import pytest

from conftest import PRODUCER_SEED, wait_for
from kvconnect.shards import attention, rank_plan, replicated, write_plan
from kvconnect.workload.tp import consecutive_ports
from test_pd_push import pushes
from test_pd_tp import LOCAL, NUM_BLOCKS, REMOTE, _groups, _remote, assert_shard_landed, decode_ranks
from tp_caches import tp_caches

pytestmark = pytest.mark.timeout(240)

# (prefill TP, decode TP, kind): head splits both ways, equal sizes above 1, KV heads fewer than the
# ranks, a replicated latent (where only some ranks write), a hybrid page split by channel and head, and
# a hybrid whose attention and Mamba2 groups share one region (replicated B/C parts written to every holder).
CASES = [(2, 1, "tp-hnd-4"), (1, 2, "tp-hnd-4"), (2, 2, "tp-hnd-8"), (4, 2, "tp-hnd-2"), (1, 2, "tp-nhd-8"),
         (2, 1, "tp-mla"), (1, 2, "tp-mla"), (2, 1, "tp-hybrid"), (1, 2, "tp-shared")]
MOONCAKE_CASES = [(2, 1, "tp-hnd-4"), (1, 2, "tp-nhd-8"), (1, 2, "tp-mla")]


def prefill_ranks(producer_processes, backend: str, kind: str, tp: int):
    """One push-mode prefill process per TP rank, rank r at base port + r."""
    from pd_peer import Topology

    base = consecutive_ports(Topology.from_env().producer_host, tp)
    ranks = [producer_processes(kind, NUM_BLOCKS, PRODUCER_SEED, engine_id="prefill-tp", rank=r, world_size=tp,
                                backend=backend, push=True, port=base + r) for r in range(tp)]
    assert [p.port for p in ranks] == list(range(base, base + tp))
    return ranks


def push_decode_ranks(backend: str, kind: str, tp: int, made: list):
    """Decode ranks with push on, caches zeroed."""
    return decode_ranks(backend, kind, tp, made, push=True)


def _push(backend, producer_processes, made, p_tp, d_tp, kind, key="k"):
    prefills = prefill_ranks(producer_processes, backend, kind, p_tp)
    decoders = push_decode_ranks(backend, kind, d_tp, made)
    for conn, _ in decoders:
        conn.expect_push(key, (prefills[0].host, prefills[0].port, p_tp), _groups(kind), 100, handle="h")
    for p in prefills:
        p.call("push", key, _remote(kind))
    return prefills, decoders


def _check_landed(decoders, kind, d_tp):
    for r, (_, caches) in enumerate(decoders):
        assert_shard_landed(caches, kind, d_tp, r, "pushed")


def _run(backend, producer_processes, made, p_tp, d_tp, kind):
    prefills, decoders = _push(backend, producer_processes, made, p_tp, d_tp, kind)
    for r, (conn, _) in enumerate(decoders):
        fin = wait_for(conn, ["h"])
        assert fin.loaded == ["h"], fin.failed
    _check_landed(decoders, kind, d_tp)
    for p in prefills:
        assert pushes(p, ["k"]) == {"k": ""}
        assert p.held_blocks() == 0
    assert all(conn.held_blocks == 0 for conn, _ in decoders)


@pytest.mark.parametrize("p_tp,d_tp,kind", CASES, ids=[f"{k}-P{p}-D{d}" for p, d, k in CASES])
def test_a_push_lands_each_decode_ranks_shard_of_every_prefill_rank_over_nixl(producer_processes, made_connectors,
                                                                             p_tp, d_tp, kind):
    _run("nixl", producer_processes, made_connectors, p_tp, d_tp, kind)


@pytest.mark.parametrize("p_tp,d_tp,kind", MOONCAKE_CASES, ids=[f"{k}-P{p}-D{d}" for p, d, k in MOONCAKE_CASES])
def test_a_push_lands_each_decode_ranks_shard_of_every_prefill_rank_over_mooncake(producer_processes,
                                                                                 made_connectors, p_tp, d_tp, kind):
    _run("mooncake", producer_processes, made_connectors, p_tp, d_tp, kind)


def test_a_layerwise_push_between_tp_sizes_lands_region_by_region(producer_processes, made_connectors):
    prefills = prefill_ranks(producer_processes, "nixl", "tp-hnd-4", 2)
    decoders = push_decode_ranks("nixl", "tp-hnd-4", 1, made_connectors)
    (conn, _), = decoders
    conn.expect_push("lw", (prefills[0].host, prefills[0].port, 2), [LOCAL[0]], 100, handle="h")
    names = list(tp_caches("tp-hnd-4", NUM_BLOCKS, PRODUCER_SEED, tp=2, rank=0)[0])
    for p in prefills:
        p.call("push_layerwise", "lw", REMOTE)
    for p in prefills:  # the decode offered already: every layer goes to a running WRITE as it completes
        deadline = time.monotonic() + 30.0
        while p.call("layers", names[:1]) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        p.call("layers", names)
        p.call("forward_done")
    assert wait_for(conn, ["h"]).loaded == ["h"]
    _check_landed(decoders, "tp-hnd-4", 1)
    assert all(pushes(p, ["lw"]) == {"lw": ""} for p in prefills)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_a_failed_write_of_one_prefill_rank_fails_every_decode_rank_it_writes_and_frees_their_blocks(
        producer_processes, made_connectors, p_tp, d_tp):
    prefills = prefill_ranks(producer_processes, "nixl", "tp-hnd-4", p_tp)
    prefills[-1].call("fail_posts", 1)
    decoders = push_decode_ranks("nixl", "tp-hnd-4", d_tp, made_connectors)
    for conn, _ in decoders:
        conn.expect_push("k", (prefills[0].host, prefills[0].port, p_tp), [LOCAL[0]], 100, handle="h",
                         timeout_s=20.0)
    for p in prefills:
        p.call("push", "k", REMOTE)
    failed = []
    for r, (conn, _) in enumerate(decoders):
        fin = wait_for(conn, ["h"], timeout=40.0)
        assert fin.loaded == ["h"] or fin.invalid_block_ids == set(LOCAL[0]), fin
        failed += [r] if "h" in fin.failed else []
        assert conn.held_blocks == 0
    # The decode rank the failed WRITE went to fails; one whose own part landed before its sibling was
    # aborted may report loaded (all its bytes are there), but the request fails on the decode.
    assert failed and (d_tp > 1 or failed == [0])
    assert pushes(prefills[-1], ["k"])["k"], "the rank whose WRITE failed reported it pushed"
    for p in prefills:
        assert p.held_blocks() == 0


def test_a_dead_prefill_rank_fails_the_decode_at_once_and_frees_its_blocks(producer_processes, made_connectors):
    prefills = prefill_ranks(producer_processes, "nixl", "tp-hnd-4", 2)
    prefills[1].kill()
    (conn, _), = push_decode_ranks("nixl", "tp-hnd-4", 1, made_connectors)
    conn.push_role.offers.timeout_s = 2.0
    conn.expect_push("k", (prefills[0].host, prefills[0].port, 2), [LOCAL[0]], 100, handle="h", timeout_s=60.0)
    prefills[0].call("push", "k", REMOTE)
    t0 = time.monotonic()
    fin = wait_for(conn, ["h"], timeout=30.0)
    assert fin.failed["h"].stage == "offer" and fin.invalid_block_ids == set(LOCAL[0]), fin
    assert time.monotonic() - t0 < 30.0, "the decode waited for its deadline although an offer failed"
    assert conn.held_blocks == 0
    assert prefills[0].held_blocks() == 0


# ---- the plan itself, without processes ----

def test_every_decode_rank_is_written_once_per_part_even_where_it_replicates_the_prefills_parts():
    mla = [replicated(4096)]
    # P1 -> D2 of a replicated latent: the one prefill rank writes both decode ranks (a READ plan would
    # have it cover its own page from decode rank 0 alone).
    assert rank_plan(mla, 1, 0, 2).reads == (0,)
    assert write_plan(mla, 1, 0, 2).reads == (0, 1) and write_plan(mla, 1, 0, 2).readers == (1, 1)
    # P2 -> D1: one prefill rank's latent is enough; the other writes nothing.
    assert write_plan(mla, 2, 0, 1).reads == (0,) and write_plan(mla, 2, 1, 1).reads == ()
    heads = [attention(16, 1, 64, 2, True)]
    # P4 -> D2 with 2 KV heads: decode rank d takes head d from one of the two prefill replicas of it.
    plans = [write_plan(heads, 4, r, 2) for r in range(4)]
    assert sum(len(p.reads) for p in plans) == 2 and plans[0].readers == (1, 1)


def test_a_lease_given_up_ends_once_every_rank_that_claimed_it_finished_not_when_its_claim_runs_out():
    from kvconnect.pd.leases import LeaseTable, ReleaseReason

    now = [0.0]
    table = LeaseTable(lease_s=30.0, clock=lambda: now[0], quiesce_s=2.0)
    table.hold("a", [[1, 2]], 16, hard=True, readers=2)
    table.claim(["a"], 60.0, readers=2, claimant=("prefill", 0))
    assert table.release("a", ReleaseReason.DONE, ("prefill", 0), 2)
    assert table.drain_released() == []  # the other writer may still come
    table.release("a", ReleaseReason.ABORTED)  # the decode gives up (an offer to the other rank failed)
    assert [r.reason for r in table.drain_released()] == [ReleaseReason.ABORTED]
    # Given up while a claimant still writes: it ends when that claimant says so, not before.
    table.hold("b", [[3]], 16, hard=True, readers=2)
    table.claim(["b"], 60.0, readers=2, claimant=("prefill", 1))
    table.release("b", ReleaseReason.ABORTED)
    assert table.drain_released() == []
    assert table.claim(["b"], 60.0, readers=2, claimant=("prefill", 0))[1] == {"b": "lease aborted"}
    table.release("b", ReleaseReason.DONE, ("prefill", 1), 2)
    assert [r.reason for r in table.drain_released()] == [ReleaseReason.ABORTED]


def test_a_prefills_rank_ports_are_free_and_outside_the_ephemeral_range():
    """The ranks' ports are free when handed out and lie below the range outgoing connections draw from,
    so no connection made between the check and the ranks' binds can take one."""
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(5):
        base = consecutive_ports("127.0.0.1", 4)
        assert base + 4 <= ephemeral or ephemeral <= 20004, (base, ephemeral)
        held = [socket.socket() for _ in range(4)]
        try:
            for p, s in enumerate(held):
                s.bind(("127.0.0.1", base + p))
        finally:
            for s in held:
                s.close()
