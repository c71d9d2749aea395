"""The P/D conformance suite: every transport must pass it, over its real library, between real processes.

Every byte checked, every fault reported within its deadline, nothing left held. The producer is a
process of its own (tests/pd_peer.py) with its own transport and side channel; this process is the
consumer. Where a fault cannot be provoked for real, the test says it uses FaultyTransport, a wrapper
around the real transport under test.

By default both sides run on loopback with CPU caches. `KVCONNECT_TEST_*` variables (see
`pd_peer.Topology`) move the producer into another network namespace or onto another host, bind each
side to an address of its own and put the caches on a GPU; integration/multihost and integration/gpu
run this suite that way.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch

from conftest import PRODUCER_SEED, assert_pulled, byte_rows, real_transport, snapshot, wait_for
from kvconnect.errors import BlockRangeError, KVConnectError
from kvconnect.faults import FaultyTransport
from pd_peer import Topology

@pytest.mark.parametrize("kind", ["dense", "mla", "hybrid", "cross"])
def test_random_block_tables_arrive_byte_exact_and_nothing_else_changes(kind, producers, consumers) -> None:
    producer = producers(kind, 64, PRODUCER_SEED)
    conn, caches = consumers(kind, 80)
    before = snapshot(caches, conn)
    rng = np.random.default_rng(0)
    n_groups = 2 if kind == "hybrid" else 1
    pulls = []
    for i in range(3):
        remote = [rng.permutation(64)[:9] for _ in range(n_groups)]
        # Each request's blocks are disjoint on the consumer, as an engine's allocator makes them:
        # the first takes random even ids, the others runs of odd ones (merged on neither side).
        if i == 0:
            local = [rng.permutation(40)[:9] * 2 for _ in range(n_groups)]
        else:
            local = [np.arange(i * 9, i * 9 + 9) * 2 + 1 for _ in range(n_groups)]
        params = producer.hold(f"req-{i}", remote, tokens=9 * 16 - 5)  # a partial last block
        conn.start_load(params, local)
        pulls.append((local, remote))
        res = wait_for(conn, [f"req-{i}"])
        assert not res.failed, res.failed
    assert_pulled(conn, caches, before, producer, pulls)
    assert producer.held_blocks() == 0


def test_a_prefix_held_by_the_consumer_is_not_pulled_again(producers, consumers) -> None:
    producer = producers("dense", 32, PRODUCER_SEED)
    conn, caches = consumers("dense", 32)
    before = snapshot(caches, conn)
    remote = [np.array([5, 9, 2, 17, 30, 11])]
    params = producer.hold("req-prefix", remote, tokens=6 * 16)
    local_suffix = [np.array([20, 21])]  # the consumer already holds the first four blocks' worth
    conn.start_load(params, local_suffix)
    assert not wait_for(conn, ["req-prefix"]).failed
    assert_pulled(conn, caches, before, producer, [(local_suffix, [remote[0][-2:]])])
    assert producer.held_blocks() == 0


def test_thirty_two_concurrent_requests_all_arrive(producers, consumers) -> None:
    producer = producers("dense", 256, PRODUCER_SEED)
    conn, caches = consumers("dense", 256)
    before = snapshot(caches, conn)
    rng = np.random.default_rng(1)
    remote_all, local_all = rng.permutation(256), rng.permutation(256)
    pulls = []
    for i in range(32):
        remote, local = [remote_all[i * 8:(i + 1) * 8]], [local_all[i * 8:(i + 1) * 8]]
        params = producer.hold(f"c-{i}", remote, tokens=8 * 16)
        pulls.append((local, remote))
        conn.start_load(params, local)
    res = wait_for(conn, [f"c-{i}" for i in range(32)])
    assert not res.failed, res.failed
    assert_pulled(conn, caches, before, producer, pulls)
    assert producer.held_blocks() == 0


# ---- faults: each ends in a reported failure within its deadline, and nothing stays held ----


class _PostSignal(FaultyTransport):
    """The real NIXL transport, plus a flag raised when a transfer is posted (nothing injected)."""

    posted = False

    def post(self, *args, **kw):
        handle = super().post(*args, **kw)
        self.posted = True
        return handle


def test_producer_killed_mid_transfer_fails_the_load_within_its_deadline(producers, consumers, monkeypatch, backend) -> None:
    if backend == "nixl":
        # UCX over TCP (both processes) moves about 0.3 GB/s here, so 384 MiB is still in flight when
        # the SIGKILL lands; over cross-memory attach the pull could finish before the kill took effect.
        # GPU memory over TCP needs UCX's cuda_copy to stage it through host memory.
        monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy" if Topology.from_env().uses_cuda else "tcp")
    producer = producers("big", 6144, PRODUCER_SEED)
    transport = _PostSignal(real_transport(backend))
    conn, _ = consumers("big", 6144, transport=transport, load_timeout_s=8.0)
    params = producer.hold("doomed", [np.arange(6144)], tokens=6144 * 16)
    conn.start_load(params, [np.arange(6144)])
    deadline = time.monotonic() + 20
    while not transport.posted and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert transport.posted
    producer.kill()
    t0 = time.monotonic()
    res = wait_for(conn, ["doomed"], timeout=8.0 + 5.0)
    assert "doomed" in res.failed, "a pull from a killed producer must be reported failed"
    assert time.monotonic() - t0 < 8.0 + 5.0
    assert res.invalid_block_ids == set(range(6144))
    assert conn.consumer.pending == 0


def test_lease_expires_without_heartbeats_and_a_late_read_is_refused(producers, consumers) -> None:
    producer = producers("dense", 32, PRODUCER_SEED, lease_s=0.5)
    conn, caches = consumers("dense", 32)
    before = snapshot(caches, conn)
    params = producer.hold("late", [np.array([1, 2, 3])], tokens=48)
    assert producer.held_blocks(wait_s=5.0) == 0  # expired: no consumer heartbeated for it
    assert ("late", "expired") in producer.call("releases")
    conn.start_load(params, [np.array([4, 5, 6])])
    res = wait_for(conn, ["late"])
    assert res.failed["late"].stage == "lease" and "lease expired" in res.failed["late"].reason
    assert res.invalid_block_ids == {4, 5, 6}
    assert all(torch.equal(a, b) for a, b in zip(byte_rows(caches, conn), before)), "a refused read moved bytes"


def test_heartbeats_keep_a_slow_pull_alive_past_the_lease(producers, consumers, backend) -> None:
    # FaultyTransport (fault injection) holds the real transfer PENDING for 2 s, four leases long.
    producer = producers("dense", 32, PRODUCER_SEED, lease_s=0.5)
    transport = FaultyTransport(real_transport(backend), delay_s=2.0)
    conn, caches = consumers("dense", 32, transport=transport, heartbeat_s=0.1)
    before = snapshot(caches, conn)
    params = producer.hold("slow", [np.array([7, 8])], tokens=32)
    conn.start_load(params, [np.array([0, 1])])
    assert not wait_for(conn, ["slow"]).failed
    assert_pulled(conn, caches, before, producer, [([np.array([0, 1])], [np.array([7, 8])])])
    assert ("slow", "done") in producer.call("releases")


def test_abort_on_the_producer_releases_blocks_and_refuses_the_read(producers, consumers) -> None:
    producer = producers("dense", 32, PRODUCER_SEED)
    conn, _ = consumers("dense", 32)
    params = producer.hold("gone", [np.array([3, 4])], tokens=32)
    assert producer.call("abort", "gone") is True
    assert producer.call("abort", "gone") is False  # released exactly once
    conn.start_load(params, [np.array([0, 1])])
    assert "lease aborted" in wait_for(conn, ["gone"]).failed["gone"].reason
    assert producer.call("releases").count(("gone", "aborted")) == 1
    assert producer.held_blocks() == 0


def test_abort_on_the_consumer_reports_failure_and_frees_the_producer(producers, consumers, backend) -> None:
    # FaultyTransport (fault injection) keeps the transfer PENDING so the abort lands mid-pull.
    producer = producers("dense", 32, PRODUCER_SEED)
    conn, _ = consumers("dense", 32, transport=FaultyTransport(real_transport(backend), delay_s=30.0))
    params = producer.hold("cancel", [np.array([3, 4])], tokens=32)
    conn.start_load(params, [np.array([0, 1])])
    time.sleep(0.5)
    conn.abort("cancel")
    res = wait_for(conn, ["cancel"], timeout=5.0)
    assert res.failed["cancel"].stage == "abort" and res.invalid_block_ids == {0, 1}
    assert producer.held_blocks() == 0
    assert ("cancel", "aborted") in producer.call("releases")


def test_remote_block_ids_out_of_range_are_rejected_before_posting(producers, consumers, backend) -> None:
    producer = producers("dense", 32, PRODUCER_SEED)
    transport = _PostSignal(real_transport(backend))
    conn, _ = consumers("dense", 64, transport=transport)
    params = producer.hold("bad", [np.array([1, 2])], tokens=32)
    params["block_ids"] = [[1, 40]]  # past the producer's 32 blocks, as a garbled router might send
    conn.start_load(params, [np.array([0, 1])])
    res = wait_for(conn, ["bad"])
    assert res.failed["bad"].stage == "params" and "block id 40" in res.failed["bad"].reason and not transport.posted
    assert producer.held_blocks() == 0  # the abort notice released the real request


def test_a_dead_side_channel_fails_the_load_within_the_handshake_deadline(consumers) -> None:
    conn, _ = consumers("dense", 16, handshake_timeout_s=1.0)
    # A free port on this process's own loopback (a network namespace has its own `lo`): nobody listens.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    params = {"engine_id": "prefill-0", "host": "127.0.0.1", "port": dead_port, "request_id": "x",
              "block_ids": [[1]], "num_tokens": 16, "lease_expiry": time.time() + 30, "incarnation": "abc"}
    t0 = time.monotonic()
    conn.start_load(params, [[0]])
    # While a load reads a lease, releasing that lease would free blocks under the READ: refused.
    with pytest.raises(KVConnectError, match="is being read by load 'x'; abort that load instead"):
        conn.release_remote(params)
    res = wait_for(conn, ["x"], timeout=5.0)
    assert res.failed["x"].stage == "handshake" and time.monotonic() - t0 < 1.0 + 3.0


def test_a_restarted_producer_is_re_handshaken_and_old_params_fail(producers, consumers) -> None:
    # The restart reuses the first producer's port, which is free where the producer runs (another
    # namespace or host, perhaps) once that producer is dead.
    first = producers("dense", 32, PRODUCER_SEED)
    port = first.port
    conn, caches = consumers("dense", 32)
    p1 = first.hold("a", [np.array([1])], tokens=16)
    stale = first.hold("stale", [np.array([2])], tokens=16)
    conn.start_load(p1, [[0]])
    assert not wait_for(conn, ["a"]).failed
    first.kill()
    second = producers("dense", 32, PRODUCER_SEED + 1, port=port)
    assert second.incarnation != first.incarnation
    before = snapshot(caches, conn)
    conn.start_load(stale, [[3]])
    failure = wait_for(conn, ["stale"]).failed["stale"]
    assert (failure.stage, failure.kind) == ("lease", "restarted") and "restarted" in failure.reason
    p2 = second.hold("b", [np.array([5, 6])], tokens=32)
    conn.start_load(p2, [[8, 9]])
    assert not wait_for(conn, ["b"]).failed
    assert_pulled(conn, caches, before, second, [([[8, 9]], [[5, 6]])])
    assert second.held_blocks() == 0


def test_a_consumer_on_another_backend_fails_at_handshake_naming_the_transport(producers, consumers, backend) -> None:
    other = "mooncake" if backend == "nixl" else "nixl"
    producer = producers("dense", 16, PRODUCER_SEED)
    conn, _ = consumers("dense", 16, backend=other)
    params = producer.hold("mixed", [np.array([1])], tokens=16)
    conn.start_load(params, [[0]])
    failure = wait_for(conn, ["mixed"]).failed["mixed"]
    reason = failure.reason
    assert failure.stage == "handshake" and "transport" in reason and backend in reason and other in reason
    assert producer.held_blocks() == 0


@pytest.mark.parametrize("kind, named", [
    ("hybrid-small-state", "group 1 (mamba) page bytes of its layer 0: ours 2048, peer's 4096"),
    ("hybrid-regrouped", "layer-to-group map"),
])
def test_a_decode_with_another_hybrid_layout_fails_at_handshake_naming_the_difference(
        kind, named, producers, consumers) -> None:
    producer = producers("hybrid", 16, PRODUCER_SEED)
    conn, caches = consumers(kind, 16)
    before = snapshot(caches, conn)
    params = producer.hold("other-layout", [np.array([1, 2]), np.array([3])], tokens=32)
    conn.start_load(params, [[4, 5], [6]])
    failure = wait_for(conn, ["other-layout"]).failed["other-layout"]
    assert failure.stage == "handshake" and "incompatible peer" in failure.reason and named in failure.reason, failure
    assert all(torch.equal(a, b) for a, b in zip(snapshot(caches, conn), before))  # nothing written
    assert producer.held_blocks() == 0


def test_a_decode_with_another_group_count_is_refused_at_start_and_can_release(producers, consumers) -> None:
    producer = producers("hybrid", 16, PRODUCER_SEED)
    conn, caches = consumers("hybrid-one-group", 16)
    before = snapshot(caches, conn)
    params = producer.hold("one-group", [np.array([1, 2]), np.array([3])], tokens=32)
    with pytest.raises(BlockRangeError, match="transfer params carry 2 KV groups, this connector has 1"):
        conn.start_load(params, [[4, 5]])
    conn.release_remote(params)
    deadline = time.monotonic() + 10
    while producer.held_blocks() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert producer.held_blocks() == 0
    assert all(torch.equal(a, b) for a, b in zip(snapshot(caches, conn), before))
