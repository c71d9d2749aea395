"""Push mode on the real transports: a decode offers blocks, a prefill in another process writes into them.

The prefill is a `pd_peer` process with push on; the decode is a connector in this process. Bytes are
compared with the prefill's seeded caches block for block, and blocks no push names must not change.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from conftest import assert_pulled, snapshot, wait_for
from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.sidechannel import call

pytestmark = pytest.mark.timeout(180)

QUIESCE_S = 2.0  # how long past a claim a hold outlives it (the producer's default)


def pushes(prefill, handles, timeout: float = 30.0) -> dict[str, str]:
    """Wait until the prefill reported every push in `handles` ended; handle -> "" (landed) or why it failed."""
    deadline = time.monotonic() + timeout
    while True:
        done = dict(prefill.call("pushes"))
        if set(handles) <= set(done) or time.monotonic() > deadline:
            missing = set(handles) - set(done)
            assert not missing, f"the prefill never reported pushes {sorted(missing)}"
            return done
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("order", ["offer-first", "prefill-first"])
def test_a_push_writes_the_prefills_blocks_into_the_offered_ones(kind, order, producers, consumers) -> None:
    prefill = producers(kind, 64, seed=7, push=True)
    decode, caches = consumers(kind, 48, push=True)
    before = snapshot(caches, decode)
    groups = len(decode.group_regions)
    remote = [[3, 9, 10, 11, 40]] * groups
    local = [[5, 6, 7, 30, 2]] * groups
    if order == "prefill-first":
        prefill.call("push", "k1", remote)
    decode.expect_push("k1", (prefill.host, prefill.port), local, 80, handle="r1")
    if order == "offer-first":
        time.sleep(0.2)  # the offer is in the prefill's table before it is ready
        prefill.call("push", "k1", remote)
    fin = wait_for(decode, ["r1"])
    assert fin.loaded == ["r1"] and not fin.failed, fin.failed
    assert pushes(prefill, ["k1"]) == {"k1": ""}
    assert_pulled(decode, caches, before, prefill, [(local, remote)])
    assert decode.held_blocks == 0 and prefill.held_blocks() == 0


def test_a_decode_holding_a_prefix_gets_only_the_suffix_written(producers, consumers) -> None:
    prefill = producers("dense", 64, seed=7, push=True)
    decode, caches = consumers("dense", 48, push=True)
    before = snapshot(caches, decode)
    prefill.call("push", "k", [[1, 2, 3, 4, 5]])
    decode.expect_push("k", (prefill.host, prefill.port), [[20, 21]], 80, handle="r")
    assert wait_for(decode, ["r"]).loaded == ["r"]
    assert_pulled(decode, caches, before, prefill, [([[20, 21]], [[4, 5]])])


def test_sixteen_concurrent_pushes_all_land(producers, consumers) -> None:
    prefill = producers("dense", 256, seed=3, push=True)
    decode, caches = consumers("dense", 256, push=True)
    before = snapshot(caches, decode)
    rng = np.random.default_rng(5)
    pairs = []
    local_pool, remote_pool = rng.permutation(256).tolist(), rng.permutation(256).tolist()
    for i in range(16):
        local, remote = [local_pool[i * 8:(i + 1) * 8]], [remote_pool[i * 8:(i + 1) * 8]]
        pairs.append((local, remote))
        if i % 2:
            prefill.call("push", f"k{i}", remote)
        decode.expect_push(f"k{i}", (prefill.host, prefill.port), local, 128, handle=f"r{i}")
    for i in range(0, 16, 2):
        prefill.call("push", f"k{i}", pairs[i][1])
    fin = wait_for(decode, [f"r{i}" for i in range(16)])
    assert sorted(fin.loaded) == sorted(f"r{i}" for i in range(16)), fin.failed
    assert set(pushes(prefill, [f"k{i}" for i in range(16)]).values()) == {""}
    assert_pulled(decode, caches, before, prefill, pairs)


def test_a_prefill_that_never_writes_fails_the_decode_within_its_deadline(producers, consumers) -> None:
    prefill = producers("dense", 16, seed=1, push=True)
    decode, _ = consumers("dense", 16, push=True)
    started = time.monotonic()
    decode.expect_push("never", (prefill.host, prefill.port), [[1, 2]], 32, handle="r", timeout_s=1.0)
    fin = wait_for(decode, ["r"], timeout=15)
    assert "within the deadline" in fin.failed["r"].reason and fin.invalid_block_ids == {1, 2}
    assert time.monotonic() - started < 10
    assert decode.held_blocks == 0


def test_a_prefill_with_no_offer_gives_its_blocks_back_after_its_lease(producers) -> None:
    prefill = producers("dense", 16, seed=1, push=True, lease_s=1.0)
    prefill.call("push", "orphan", [[1, 2, 3]])
    done = pushes(prefill, ["orphan"], timeout=15)
    assert "no decode offered blocks" in done["orphan"]


def test_an_offer_to_a_dead_prefill_fails_at_once(consumers) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    decode, _ = consumers("dense", 16, push=True, handshake_timeout_s=1.0)
    decode.expect_push("k", ("127.0.0.1", port), [[1]], 16, handle="r", timeout_s=60)
    fin = wait_for(decode, ["r"], timeout=15)
    assert fin.failed["r"].stage == "offer" and decode.held_blocks == 0


def test_an_abort_on_the_decode_waits_for_the_write_to_stop(producers, consumers) -> None:
    prefill = producers("big", 512, seed=2, push=True)
    decode, caches = consumers("big", 512, push=True)
    ids = [list(range(512))]
    decode.expect_push("big", (prefill.host, prefill.port), ids, 512 * 16, handle="r")
    prefill.call("push", "big", ids)
    time.sleep(0.05)
    decode.abort("r")
    fin = wait_for(decode, ["r"], timeout=60)
    # The abort raced the WRITE: either the WRITE landed first (a load), or the decode reports the
    # abort only once the prefill's WRITE is over, which the prefill had reported before it said so.
    ended = dict(prefill.call("pushes"))
    assert fin.loaded == ["r"] or fin.failed["r"].stage == "abort"
    assert "big" in ended, "the decode gave its blocks back while the prefill's WRITE was still running"
    assert decode.held_blocks == 0 and prefill.held_blocks() == 0


def test_an_offer_naming_blocks_the_decode_does_not_have_is_refused_before_any_write(producers, consumers) -> None:
    prefill = producers("dense", 16, seed=1, push=True)
    decode, caches = consumers("dense", 16, push=True)
    before = snapshot(caches, decode)
    # A hostile (or stale) offer for the decode's own engine, naming blocks past its region.
    params = decode.producer.hold("h", [[1]], 16)
    bad = wire.TransferParams(**{**wire.transfer_params_to_builtins(params), "block_ids": [[1 << 40]],
                                 "request_id": "hostile"})
    reply = call(prefill.host, prefill.port, wire.Offer(engine_id="x", rank=0, key="k", params=bad))
    assert reply.live == ("k",)
    prefill.call("push", "k", [[3]])
    assert "rejected" in pushes(prefill, ["k"])["k"]
    assert all(a.equal(b) for a, b in zip(snapshot(caches, decode), before))
    decode.producer.abort("h")


def test_push_between_tp_sizes_without_a_described_split_is_refused_by_name(producers, consumers) -> None:
    decode, _ = consumers("dense", 16, push=True, world_size=2, rank=0)
    with pytest.raises(KVConnectError, match="cannot map prefill TP 1 onto decode TP 2"):
        decode.expect_push("k", ("127.0.0.1", 1), [[1]], 16, handle="r")
    assert decode.held_blocks == 0


def test_the_prefill_killed_mid_write_fails_the_decode_within_its_deadline(producers, consumers) -> None:
    prefill = producers("big", 512, seed=2, push=True)
    decode, _ = consumers("big", 512, push=True)
    ids = [list(range(512))]
    decode.expect_push("big", (prefill.host, prefill.port), ids, 512 * 16, handle="r", timeout_s=5.0)
    prefill.call("push", "big", ids)
    prefill.kill()
    fin = wait_for(decode, ["r"], timeout=30)
    assert fin.loaded == ["r"] or fin.failed["r"]
    assert decode.held_blocks == 0


def test_a_routers_shorter_deadline_fails_a_push_whose_prefill_died_mid_write_at_that_deadline(
        producers, consumers) -> None:
    """The decode's load_timeout_s is 60 s; the request's own 3 s (as a router sets it) bounds its hold:
    never freed before it, failed at it plus the quiesce time, with the prefill dead after its first layer."""
    prefill = producers("dense", 16, seed=1, push=True)
    decode, caches = consumers("dense", 16, push=True)
    assert decode.config.load_timeout_s == 60.0
    timeout = wire.load_timeout_from_builtins(3.0, decode.config.load_timeout_s)
    local, remote = [[1, 2]], [[3, 4]]
    t0 = time.monotonic()
    decode.expect_push("dies", (prefill.host, prefill.port), local, 32, handle="r", timeout_s=timeout)
    prefill.call("push_layerwise", "dies", remote)
    prefill.call("layers", ["layers.0.attn"])
    while not _rows_equal(caches, decode, prefill, local[0], remote[0], 0):  # claimed: a WRITE is running
        assert time.monotonic() - t0 < timeout, "the first layer was not written within the deadline"
        time.sleep(0.01)
    prefill.kill()
    fin = wait_for(decode, ["r"], timeout=30)
    elapsed = time.monotonic() - t0
    assert "within the deadline" in fin.failed["r"].reason and fin.invalid_block_ids == {1, 2}
    assert timeout <= elapsed < timeout + QUIESCE_S + 10, elapsed  # a liveness bound, far below the 60 s
    assert decode.held_blocks == 0


# ---- the bookkeeping on its own: leases under a claim, the pusher's table, the adapter's params ----

def test_an_engine_abort_under_a_claim_ends_the_lease_only_once_the_claim_is_over() -> None:
    from kvconnect.pd.leases import LeaseTable, ReleaseReason

    now = [0.0]
    table = LeaseTable(lease_s=1.0, clock=lambda: now[0], quiesce_s=2.0)
    table.hold("r", [[1, 2]], 32)
    granted, _ = table.claim(["r"], 5.0)
    assert granted == {"r": 5.0}
    assert table.release("r", ReleaseReason.ABORTED)  # the engine gives up while a WRITE may run
    assert table.drain_released() == [] and table.held_blocks == 2
    assert table.claim(["r"], 5.0) == ({}, {"r": "lease aborted"})
    assert table.heartbeat(["r"]) == []
    now[0] = 6.99  # the claim ran out at 5; the quiesce time keeps the blocks 2 s more
    assert table.drain_released() == []
    now[0] = 7.0
    (rel,) = table.drain_released()
    assert rel.reason is ReleaseReason.ABORTED and table.held_blocks == 0


def test_the_claimants_notice_ends_an_aborted_claimed_lease_at_once() -> None:
    from kvconnect.pd.leases import LeaseTable, ReleaseReason

    table = LeaseTable(lease_s=30.0, quiesce_s=2.0)
    table.hold("r", [[1]], 16)
    table.claim(["r"], 60.0)
    table.release("r", ReleaseReason.ABORTED)
    assert table.release("r", ReleaseReason.DONE, reader=("prefill", 0))  # its WRITE is over
    (rel,) = table.drain_released()
    assert rel.reason is ReleaseReason.ABORTED  # the engine gave it up: never reported as loaded


def test_a_hard_lease_is_never_claimed_past_its_deadline() -> None:
    from kvconnect.pd.leases import LeaseTable, ReleaseReason

    now = [0.0]
    table = LeaseTable(lease_s=30.0, clock=lambda: now[0], quiesce_s=2.0)
    table.hold("r", [[1]], 16, lease_s=3.0, hard=True)
    assert table.claim(["r"], 60.0)[0] == {"r": 3.0}  # the WRITE gets until the decode's deadline only
    assert table.heartbeat(["r"]) == ["r"]
    now[0] = 4.99  # the deadline, plus the quiesce time for a WRITE still landing
    assert table.drain_released() == []
    now[0] = 5.0
    (rel,) = table.drain_released()
    assert rel.reason is ReleaseReason.EXPIRED
    assert rel.lease_s == 3.0  # the expiry's log line names the lease this hold had, not the table's 30 s


def test_a_claimed_lease_outlives_its_claim_by_the_quiesce_time() -> None:
    from kvconnect.pd.leases import LeaseTable, ReleaseReason

    now = [0.0]
    table = LeaseTable(lease_s=1.0, clock=lambda: now[0], quiesce_s=2.0)
    table.hold("r", [[1]], 16)
    table.claim(["r"], 5.0)
    now[0] = 6.99
    assert table.drain_released() == []
    now[0] = 7.0
    assert [r.reason for r in table.drain_released()] == [ReleaseReason.EXPIRED]


class _RecordingConsumer:
    """Stands in for the consumer behind a Pusher: records the WRITEs it is asked for."""

    world_size = 1

    def __init__(self):
        self.loads, self.params = [], []

    def load(self, params, local, *, handle, timeout_s, op, layerwise=False, fence=None):
        self.loads.append((params.request_id, [ids.tolist() for ids in local], handle, op))
        self.params.append(params)
        return handle


def _offer(key: str, blocks, tp: int = 1, rank: int = 0, ranks: int = 1) -> wire.Offer:
    """Decode rank `rank` of `tp` offers; `ranks` > 1: params naming that many ranks (which no offer may)."""
    named = tuple(wire.RankAddr(host="127.0.0.1", port=5600 + r, incarnation="i") for r in range(ranks)) \
        if ranks > 1 else ()
    return wire.Offer(engine_id="decode", rank=rank, key=key, tp_size=tp, params=wire.TransferParams(
        engine_id="decode", host="127.0.0.1", port=5600 + rank, request_id=f"lease-{key}", block_ids=blocks,
        num_tokens=16, lease_expiry=time.time() + 60, incarnation=f"i{rank}" if ranks == 1 else "i", ranks=named))


def test_the_pusher_writes_whichever_comes_second_and_expires_what_waits_too_long() -> None:
    from kvconnect.pd.pusher import Pusher
    from kvconnect.sidechannel import Refusal

    now = [0.0]
    consumer = _RecordingConsumer()
    pusher = Pusher(consumer, wait_s=5.0, max_offers=2, clock=lambda: now[0])
    pusher.offer(_offer("a", [[7, 8]]))
    pusher.ready("a", [[1, 2, 3]], handle="ra")  # offer first: written now, the prefill's last blocks
    pusher.ready("b", [[4, 5]], handle="rb")
    pusher.offer(_offer("b", [[9, 10]]))  # prefill first: written when offered
    assert consumer.loads == [("lease-a", [[2, 3]], "ra", "WRITE"), ("lease-b", [[4, 5]], "rb", "WRITE")]
    with pytest.raises(Refusal, match="offered already"):
        pusher.offer(_offer("b", [[1]]))
    with pytest.raises(Refusal, match="one decode rank"):
        pusher.offer(_offer("c", [[1]], ranks=2))
    pusher.offer(_offer("c", [[1]]))
    pusher.offer(_offer("d", [[1]]))
    with pytest.raises(Refusal, match="wait for their prefill"):
        pusher.offer(_offer("e", [[1]]))
    pusher.ready("orphan", [[1]], handle="ro")
    now[0] = 5.0
    from kvconnect.pd.consumer import LoadResults

    out = pusher.take(LoadResults(loaded=["ra", "pull-load"]))
    assert out.pushed == ["ra"] and "no decode offered blocks" in out.failed["ro"]


def test_the_pusher_writes_once_every_decode_rank_offered_naming_them_all() -> None:
    from kvconnect.pd.pusher import Pusher
    from kvconnect.sidechannel import Refusal

    consumer = _RecordingConsumer()
    pusher = Pusher(consumer, wait_s=5.0)
    pusher.ready("a", [[1, 2]], handle="ra")
    pusher.offer(_offer("a", [[7, 8]], tp=2, rank=1))
    assert consumer.loads == []  # decode rank 0 has not offered yet
    with pytest.raises(Refusal, match="offered already"):
        pusher.offer(_offer("a", [[7, 8]], tp=2, rank=1))
    with pytest.raises(Refusal, match="of TP 2, now by decode of TP 3"):
        pusher.offer(_offer("a", [[7, 8]], tp=3, rank=0))
    with pytest.raises(Refusal, match="one decode rank"):
        pusher.offer(_offer("b", [[7, 8]], tp=2, rank=2))
    pusher.offer(_offer("a", [[7, 8]], tp=2, rank=0))
    assert consumer.loads == [("lease-a", [[1, 2]], "ra", "WRITE")]
    assert [(r.port, r.incarnation) for r in consumer.params[0].ranks] == [(5600, "i0"), (5601, "i1")]


def test_a_prefill_rank_missing_a_decode_ranks_offer_fails_its_push_after_its_wait_naming_how_many_came() -> None:
    from kvconnect.pd.consumer import LoadResults
    from kvconnect.pd.pusher import Pusher

    now = [0.0]
    consumer = _RecordingConsumer()
    pusher = Pusher(consumer, wait_s=5.0, clock=lambda: now[0])
    pusher.ready("a", [[1, 2]], handle="ra")
    pusher.offer(_offer("a", [[7, 8]], tp=2, rank=0))
    now[0] = 5.0
    assert "1 of 2 decode ranks offered" in pusher.take(LoadResults()).failed["ra"]
    assert consumer.loads == [] and pusher.pending == 0


def test_a_decode_offering_more_blocks_than_the_prefill_computed_fails_the_push() -> None:
    from kvconnect.pd.consumer import LoadResults
    from kvconnect.pd.pusher import Pusher

    pusher = Pusher(_RecordingConsumer(), wait_s=5.0)
    pusher.offer(_offer("a", [[7, 8, 9]]))
    pusher.ready("a", [[1, 2]], handle="ra")
    assert "the decode offers 3 blocks, the prefill computed 2" in pusher.take(LoadResults()).failed["ra"]


# ---- layer-wise: each region written as soon as its layer is computed ----

def _rows_equal(caches, decode, prefill, local, remote, region: int) -> bool:
    from conftest import byte_rows
    from pd_peer import make_caches

    want = byte_rows(make_caches(prefill.kind, prefill.num_blocks, prefill.seed)[0], decode)[region]
    got = byte_rows(caches, decode)[region]
    return bool((got[local] == want[remote]).all())


def test_layerwise_push_writes_each_layer_as_it_is_saved_and_finishes_after_the_pass(producers, consumers) -> None:
    prefill = producers("dense", 64, seed=7, push=True)
    decode, caches = consumers("dense", 48, push=True)
    before = snapshot(caches, decode)
    local, remote = [[5, 6, 7, 30]], [[3, 9, 10, 11]]
    decode.expect_push("lw", (prefill.host, prefill.port), local, 64, handle="r")
    prefill.call("push_layerwise", "lw", remote)  # before the forward pass
    prefill.call("layers", ["layers.0.attn", "layers.1.attn"])  # two layers computed
    deadline = time.monotonic() + 30
    while not all(_rows_equal(caches, decode, prefill, local[0], remote[0], k) for k in (0, 1)):
        assert time.monotonic() < deadline, "the saved layers were not written during the pass"
        time.sleep(0.01)
    # The layers not computed yet are untouched, and the load is not done.
    assert all(torch.equal(snapshot(caches, decode)[k], before[k]) for k in (2, 3))
    assert decode.get_finished().loaded == []
    prefill.call("layers", ["layers.2.attn"])
    prefill.call("forward_done")  # the rest (layer 3) goes now
    fin = wait_for(decode, ["r"])
    assert fin.loaded == ["r"], fin.failed
    assert pushes(prefill, ["lw"]) == {"lw": ""}
    assert_pulled(decode, caches, before, prefill, [(local, remote)])


def test_layerwise_push_offered_mid_pass_writes_what_was_computed_then_the_rest(producers, consumers) -> None:
    prefill = producers("hybrid", 32, seed=4, push=True)
    decode, caches = consumers("hybrid", 32, push=True)
    before = snapshot(caches, decode)
    local, remote = [[1, 2], [3, 4]], [[8, 9], [10, 11]]
    prefill.call("push_layerwise", "lw", remote)
    prefill.call("layers", ["layers.0.attn", "layers.2.attn"])  # attention layers; state layers never say
    decode.expect_push("lw", (prefill.host, prefill.port), local, 32, handle="r")
    time.sleep(0.3)
    assert decode.get_finished().loaded == []
    prefill.call("forward_done")
    assert wait_for(decode, ["r"]).loaded == ["r"]
    assert_pulled(decode, caches, before, prefill, [(local, remote)])


def test_a_layerwise_push_whose_pass_never_ends_fails_the_decode_at_its_deadline(producers, consumers) -> None:
    prefill = producers("dense", 16, seed=1, push=True)
    decode, _ = consumers("dense", 16, push=True)
    decode.expect_push("stuck", (prefill.host, prefill.port), [[1, 2]], 32, handle="r", timeout_s=2.0)
    prefill.call("push_layerwise", "stuck", [[3, 4]])
    prefill.call("layers", ["layers.0.attn"])
    fin = wait_for(decode, ["r"], timeout=30)
    assert "r" in fin.failed and decode.held_blocks == 0
    assert pushes(prefill, ["stuck"], timeout=60)["stuck"] != ""


def test_a_layer_whose_write_fails_fails_the_push_on_both_sides(producers, consumers) -> None:
    """The first layer lands, the second's WRITE cannot be posted: the prefill reports the push failed and
    frees its blocks, and decode fails the load at once (not at its deadline) and frees its own."""
    prefill = producers("dense", 32, seed=2, push=True)
    decode, caches = consumers("dense", 32, push=True)
    local, remote = [[1, 2, 3]], [[7, 8, 9]]
    prefill.call("fail_posts", 0)  # the fault-injecting transport, passing everything through for now
    decode.expect_push("lw", (prefill.host, prefill.port), local, 48, handle="r", timeout_s=60.0)
    prefill.call("push_layerwise", "lw", remote)
    prefill.call("layers", ["layers.0.attn"])
    deadline = time.monotonic() + 30
    while not _rows_equal(caches, decode, prefill, local[0], remote[0], 0):
        assert time.monotonic() < deadline, "the first layer was not written"
        time.sleep(0.01)
    t0 = time.monotonic()
    prefill.call("fail_posts", 1)
    prefill.call("layers", ["layers.1.attn"])
    assert "injected post failure" in pushes(prefill, ["lw"])["lw"]
    fin = wait_for(decode, ["r"], timeout=30)
    assert "r" in fin.failed and "injected post failure" in str(fin.failed["r"]), fin.failed
    assert time.monotonic() - t0 < 20  # told by the prefill, well before the 60 s deadline
    assert decode.held_blocks == 0 and prefill.held_blocks() == 0


@pytest.mark.parametrize("mode", ["pull", "push", "push-layerwise"])
def test_groups_sharing_one_region_each_move_their_own_blocks(mode, producers, consumers) -> None:
    """vLLM hybrids register one tensor for layers of two KV groups: one region, a block list per group."""
    prefill = producers("hybrid-shared", 32, seed=6, push=mode != "pull")
    decode, caches = consumers("hybrid-shared", 32, push=mode != "pull")
    assert decode.group_regions == [[0], [0]]  # one region, in both groups
    before = snapshot(caches, decode)
    local, remote = [[1, 2], [20, 21]], [[5, 6], [9, 10]]
    if mode == "pull":
        params = prefill.hold("r", remote, 32)
        decode.start_load(params, local, handle="r")
    else:
        decode.expect_push("k", (prefill.host, prefill.port), local, 32, handle="r")
        prefill.call("push_layerwise" if mode == "push-layerwise" else "push", "k", remote)
        if mode == "push-layerwise":
            prefill.call("layers", ["layers.0.attn"])  # the state layer never says: the region waits for the end
            prefill.call("forward_done")
    assert wait_for(decode, ["r"]).loaded == ["r"]
    assert_pulled(decode, caches, before, prefill, [(local, remote)])
