"""Consumer isolation and deadlines, over the real backends between real processes.

One slow, dead or lying producer never delays, breaks or corrupts another producer's loads; a load's
deadline bounds everything from `start_load` to its report; one load's bad input fails that load
alone, never as "internal"; leases outlive a decode queue while the decode side keeps them alive;
an aborted load is reported only once nothing more can land in its blocks.
"""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import PRODUCER_SEED, assert_pulled, byte_rows, real_transport, snapshot, wait_for
from kvconnect import KVConnectError, wire
from kvconnect.faults import FaultyTransport, HostileListener, stalled
from kvconnect.pd.failure import Stage
from kvconnect.transport.base import TransferState
from kvconnect.sidechannel import fetch_metadata
from pd_peer import make_caches

# How much past its deadline a failing load may be reported: a liveness bound, not a speed figure.
MARGIN_S = 2.0
KNOWN_STAGES = {Stage.HANDSHAKE, Stage.PARAMS, Stage.LEASE, Stage.POST, Stage.TRANSFER, Stage.ABORT, Stage.SHUTDOWN}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def retarget(params: dict, listener) -> dict:
    """The same params, pointing at another side channel (as a garbled or hostile router would)."""
    return {**params, "host": "127.0.0.1", "port": listener.port}


def test_the_load_deadline_bounds_the_handshake_with_a_killed_producer(producers, consumers) -> None:
    producer = producers("dense", 16, PRODUCER_SEED)
    conn, _ = consumers("dense", 16, load_timeout_s=2.0, handshake_timeout_s=5.0)
    params = producer.hold("doomed", [np.array([1, 2])], tokens=32)
    producer.kill()
    t0 = time.monotonic()
    conn.start_load(params, [[0, 1]])
    res = wait_for(conn, ["doomed"], timeout=2.0 + MARGIN_S + 3.0)
    assert res.failed["doomed"].stage == "handshake"
    assert time.monotonic() - t0 < 2.0 + MARGIN_S, "the handshake waited past the load's deadline"
    assert res.invalid_block_ids == {0, 1}


def test_a_routers_shorter_deadline_bounds_a_load_from_a_killed_producer(producers, consumers) -> None:
    """load_timeout_s and handshake_timeout_s are long; the load's own 2 s (as a router sets it) bounds it."""
    producer = producers("dense", 16, PRODUCER_SEED)
    conn, _ = consumers("dense", 16, load_timeout_s=60.0, handshake_timeout_s=30.0)
    timeout = wire.load_timeout_from_builtins(2.0, conn.config.load_timeout_s)
    params = producer.hold("doomed", [np.array([1, 2])], tokens=32)
    producer.kill()
    t0 = time.monotonic()
    conn.start_load(params, [[0, 1]], timeout_s=timeout)
    res = wait_for(conn, ["doomed"], timeout=timeout + MARGIN_S + 3.0)
    assert res.failed["doomed"].stage == "handshake" and res.invalid_block_ids == {0, 1}
    assert time.monotonic() - t0 < timeout + MARGIN_S, "the load waited past its own deadline"


def test_a_stalled_producer_never_delays_another_producers_loads(producers, consumers) -> None:
    stuck, healthy = producers("dense", 16, PRODUCER_SEED, engine_id="stuck"), producers("dense", 64, PRODUCER_SEED)
    conn, caches = consumers("dense", 64, handshake_timeout_s=20.0, load_timeout_s=30.0)
    before = snapshot(caches, conn)
    held = stuck.hold("s-0", [np.array([3])], tokens=16)
    params = [healthy.hold(f"h-{i}", [np.arange(4 * i, 4 * i + 4)], tokens=64) for i in range(8)]
    with stalled(stuck.pid):
        conn.start_load(held, [[63]])  # queued first, in front of the healthy loads
        for i, p in enumerate(params):
            conn.start_load(p, [np.arange(4 * i, 4 * i + 4)])
        res = wait_for(conn, [f"h-{i}" for i in range(8)])
        assert not res.failed and conn.consumer.pending == 1, "the healthy loads waited for the stalled producer"
        assert_pulled(conn, caches, before, healthy, [([np.arange(4 * i, 4 * i + 4)], [np.arange(4 * i, 4 * i + 4)])
                                                       for i in range(8)])
    wait_for(conn, ["s-0"], timeout=30.0 + MARGIN_S)  # resumed: it ends one way or the other, in time
    assert healthy.held_blocks() == 0 and stuck.held_blocks() == 0


@pytest.mark.parametrize("blocks", [2**21, 2**45])
def test_a_listener_lying_about_a_healthy_producer_never_poisons_it(producers, consumers, blocks) -> None:
    producer = producers("dense", 32, PRODUCER_SEED)
    conn, caches = consumers("dense", 32, handshake_timeout_s=2.0, load_timeout_s=10.0)
    before = snapshot(caches, conn)
    meta = fetch_metadata(producer.host, producer.port, timeout=10.0)
    # The producer's identity, incarnation, transport blob and fingerprint, with regions of `blocks`
    # blocks each that start where the producer registered nothing.
    lie = msgspec.structs.replace(meta, regions=tuple(
        msgspec.structs.replace(r, num_blocks=blocks, base_addr=r.base_addr + (1 << 44)) for r in meta.regions))
    first = producer.hold("real-1", [np.array([1, 2])], tokens=32)
    conn.start_load(first, [[0, 1]])
    assert not wait_for(conn, ["real-1"]).failed
    with HostileListener(lie) as liar:
        mem = rss_mib()
        for i in range(3):  # a lie told once or repeatedly, before and after a real load
            fake = retarget({**first, "request_id": f"fake-{i}"}, liar)
            conn.start_load(fake, [[10 + i]])
            failure = wait_for(conn, [f"fake-{i}"]).failed.get(f"fake-{i}")
            assert failure is None or failure.stage in KNOWN_STAGES, failure
            real = producer.hold(f"real-{i + 2}", [np.array([5 + i])], tokens=16)
            conn.start_load(real, [[20 + i]])
            assert not wait_for(conn, [f"real-{i + 2}"]).failed, "the real producer stopped serving"
        assert rss_mib() - mem < 64, f"a lying peer cost {rss_mib() - mem:.0f} MiB"
    assert_pulled(conn, caches, before, producer,
                  [([[0, 1]], [[1, 2]])] + [([[20 + i]], [[5 + i]]) for i in range(3)])
    assert producer.held_blocks() == 0


def test_a_load_names_one_lease_and_is_refused_for_one_the_producer_never_held(producers, consumers) -> None:
    producer = producers("dense", 16, PRODUCER_SEED)
    conn, _ = consumers("dense", 16)
    params = producer.hold("held", [np.array([1])], tokens=16)
    with pytest.raises(TypeError, match=r"start_load\(params, local_block_ids, handle=...\)"):
        conn.start_load("held", [[0]], params)
    conn.start_load(params, [[0]], handle="engine-7")
    with pytest.raises(KVConnectError, match="already being read"):
        conn.start_load(params, [[1]], handle="engine-8")  # a second load of the same lease
    assert wait_for(conn, ["engine-7"]).loaded == ["engine-7"]
    conn.start_load({**params, "request_id": "never-held"}, [[2]], handle="engine-9")
    failure = wait_for(conn, ["engine-9"]).failed["engine-9"]
    assert failure.stage == Stage.LEASE and "unknown request" in failure.reason
    assert producer.held_blocks() == 0


def test_a_lease_read_to_the_end_is_never_read_again_even_before_its_producer_heard_done(
        producers, consumers, monkeypatch) -> None:
    # Params naming a lease this consumer already read (a router replaying or garbling them) would read
    # that request's KV into another request's blocks while the done notice is still on its way.
    from kvconnect.pd.outbox import Outbox

    producer = producers("dense", 16, PRODUCER_SEED)
    conn, _ = consumers("dense", 16)
    monkeypatch.setattr(Outbox, "send", lambda self: None)  # the done notice never leaves
    params = producer.hold("once", [np.array([1, 2])], tokens=32)
    conn.start_load(params, [[0, 1]], handle="first")
    assert wait_for(conn, ["first"]).loaded == ["first"]
    assert producer.held_blocks() == 2  # the producer still holds the lease: it never heard done
    with pytest.raises(KVConnectError, match="read by this consumer already"):
        conn.start_load(params, [[5, 6]], handle="replayed")
    monkeypatch.undo()
    conn.release_remote(params)  # frees the producer's blocks for the teardown's check


def test_keep_alive_holds_a_lease_while_the_request_waits(producers, consumers) -> None:
    producer = producers("dense", 16, PRODUCER_SEED, lease_s=1.0)
    conn, caches = consumers("dense", 16, heartbeat_s=0.2)
    before = snapshot(caches, conn)
    params = producer.hold("queued", [np.array([4, 5])], tokens=32)
    conn.keep_alive(params)
    time.sleep(3.0)  # three leases long, in decode's queue
    conn.start_load(params, [[6, 7]])
    assert not wait_for(conn, ["queued"]).failed
    assert_pulled(conn, caches, before, producer, [([[6, 7]], [[4, 5]])])
    assert ("queued", "done") in producer.call("releases")


def test_a_done_notice_to_a_producer_that_did_not_answer_is_sent_again(producers, consumers) -> None:
    producer = producers("dense", 16, PRODUCER_SEED, lease_s=120.0)
    conn, _ = consumers("dense", 16)
    params = producer.hold("busy", [np.array([2, 3])], tokens=32)
    with stalled(producer.pid):
        conn.release_remote(params)
        time.sleep(3.0)  # the first notice times out (1 s) while the producer cannot answer
    # Released well before the 120 s lease: the notice was retried once the producer answered again.
    assert producer.held_blocks(wait_s=20.0) == 0
    assert ("busy", "done") in producer.call("releases")


def test_an_aborted_read_lands_nothing_in_blocks_the_engine_reuses(producers, consumers, monkeypatch,
                                                                   backend) -> None:
    if backend == "nixl":
        # Over UCX's TCP transport a READ is asynchronous: it can be in flight while the producer is stopped.
        monkeypatch.setenv("UCX_TLS", "tcp")
    producer = producers("big", 4096, PRODUCER_SEED)
    transport = FaultyTransport(real_transport(backend))  # nothing injected: it only counts posts
    conn, caches = consumers("big", 4096, transport=transport, load_timeout_s=90.0)
    local, reverse = np.arange(4096), np.arange(4096)[::-1].copy()
    first = producer.hold("first", [local], tokens=4096 * 16)
    second = producer.hold("second", [reverse], tokens=4096 * 16)
    conn.start_load(first, [local])
    _posted(transport, inside_mooncake=backend == "mooncake")
    with stalled(producer.pid):
        conn.abort("first")
        early = _reported(conn, "first", within_s=3.0)
        if backend == "mooncake":
            # A batch inside Mooncake cannot be recalled: reporting it while the peer was stopped would let
            # the engine reuse blocks the batch may still write.
            assert transport.last_posted.state is TransferState.PENDING, "the batch ended with its peer stopped"
            assert early is None, "an abort was reported while its batch could still land"
    res = early or wait_for(conn, ["first"], timeout=90.0)
    assert res.failed["first"].stage == "abort"
    conn.start_load(second, [local])  # the same blocks, reused for another request once reported
    assert not wait_for(conn, ["second"], timeout=90.0).failed
    want = byte_rows(make_caches("big", 4096, PRODUCER_SEED)[0], conn)[0][reverse]
    assert bool((byte_rows(caches, conn)[0][local] == want).all()), "bytes of the aborted READ landed late"
    assert producer.held_blocks() == 0


def _posted(transport: FaultyTransport, inside_mooncake: bool) -> None:
    """Wait for the first post; with `inside_mooncake`, until a batch of it is inside Mooncake.

    A queued transfer whose first batch has not started can be cancelled at once, and is reported
    at once: only a batch inside the library makes an early report wrong.
    """
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        xfer = transport.last_posted
        if xfer is not None and (not inside_mooncake or xfer.running):
            return
        time.sleep(0.0005)
    raise AssertionError(f"no transfer in flight within 20 s: {transport.last_posted!r}")


def _reported(conn, handle: str, within_s: float):
    """The Finished that reports `handle` if it comes within `within_s`, else None."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        fin = conn.get_finished()
        if handle in fin.failed or handle in fin.loaded:
            return fin
        time.sleep(0.01)
    return None


# ---- bad input of every kind fails that load alone ----

_ints = st.one_of(st.integers(-5, 40), st.integers(2**31, 2**64 + 7), st.just(-(2**63) - 1))
_junk = st.one_of(st.none(), st.text(max_size=8), st.floats(allow_nan=True), st.lists(st.integers(), max_size=3))
_PARAM_MUTATIONS = {
    "block_ids": st.one_of(st.lists(st.lists(_ints, max_size=4), max_size=3), _junk),
    "port": st.one_of(_ints, _junk),
    "host": st.sampled_from(["127.0.0.1", "localhost", "::1", "256.1.1.1", "not a host", "", "x" * 300]),
    "engine_id": st.one_of(st.sampled_from(["", "prefill-0", "other", "e" * 300]), _junk),
    "request_id": st.one_of(st.sampled_from(["", "missing", "r" * 200]), _junk),
    "num_tokens": st.one_of(_ints, _junk),
    "lease_expiry": st.one_of(st.floats(allow_nan=True, allow_infinity=True), _junk),
    "incarnation": st.one_of(st.sampled_from(["", "stale", "i" * 100]), _junk),
}


@st.composite
def _mutations(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(sorted(_PARAM_MUTATIONS)), min_size=1, max_size=3, unique=True))
    return {k: draw(_PARAM_MUTATIONS[k]) for k in keys}


def _start(conn, params: dict, handle: str, as_struct: bool) -> bool:
    """Start a load from fuzzed params; False when refused at once (which must be a typed error)."""
    try:
        p = wire.TransferParams(**params) if as_struct else params
        conn.start_load(p, [[handle_block(handle)]], handle=handle)
    except (KVConnectError, TypeError) as exc:  # TypeError: the struct constructor itself refused
        assert isinstance(exc, KVConnectError) or as_struct, exc
        return False
    return True


def handle_block(handle: str) -> int:
    return 32 + int(handle.rsplit("-", 1)[1]) % 32


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(cases=st.lists(st.tuples(_mutations(), st.booleans()), min_size=12, max_size=12))
def test_fuzzed_params_fail_their_own_load_only_never_as_internal(producers, consumers, cases) -> None:
    producer, conn = _fuzz_pair(producers, consumers)
    good = producer.hold(f"good-{time.monotonic_ns()}", [np.array([7])], tokens=16)
    queued = []
    for i, (change, as_struct) in enumerate(cases):
        params = {**good, "request_id": f"fuzz-{time.monotonic_ns()}", **change}
        if _start(conn, params, f"fuzz-{i}", as_struct):
            queued.append(f"fuzz-{i}")
        if i == len(cases) // 2:
            conn.start_load(good, [[0]], handle="good")
    res = wait_for(conn, ["good", *queued], timeout=20.0)
    assert "good" in res.loaded, res.failed.get("good")
    assert all(f.stage in KNOWN_STAGES for f in res.failed.values()), res.failed


_META_MUTATIONS = {
    "regions": lambda meta, draw: tuple(msgspec.structs.replace(
        r, num_blocks=draw(st.integers(1, 2**40)), base_addr=draw(st.integers(0, 2**47)),
        block_bytes=draw(st.sampled_from([r.block_bytes, 1, r.block_bytes * 2])),
        block_stride=r.block_bytes * 4) for r in meta.regions[:draw(st.integers(1, len(meta.regions)))]),
    "group_regions": lambda meta, draw: (tuple(range(draw(st.integers(1, len(meta.regions))))),),
    "transport_metadata": lambda meta, draw: draw(st.binary(max_size=64)),
    "engine_id": lambda meta, draw: draw(st.sampled_from(["someone-else", meta.engine_id])),
}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_peer_metadata_fail_the_loads_from_that_peer_only(producers, consumers, data) -> None:
    producer, conn = _fuzz_pair(producers, consumers)
    meta = fetch_metadata(producer.host, producer.port, timeout=10.0)
    keys = data.draw(st.lists(st.sampled_from(sorted(_META_MUTATIONS)), min_size=1, max_size=3, unique=True))
    changed = {k: _META_MUTATIONS[k](meta, data.draw) for k in keys}
    try:
        lie = msgspec.structs.replace(meta, **changed)
    except (ValueError, TypeError):
        return  # the struct itself refuses: nothing could send it
    good = producer.hold(f"good-{time.monotonic_ns()}", [np.array([9])], tokens=16)
    with HostileListener(lie) as liar:
        conn.start_load(retarget({**good, "request_id": f"lie-{time.monotonic_ns()}"}, liar), [[40]], handle="lie")
        conn.start_load(good, [[1]], handle="good")
        res = wait_for(conn, ["lie", "good"], timeout=20.0)
    assert "good" in res.loaded, res.failed.get("good")
    assert all(f.stage in KNOWN_STAGES for f in res.failed.values()), res.failed


_pairs: dict = {}


def _fuzz_pair(producers, consumers):
    """One producer and one consumer per backend for every example of a fuzz test (startup is costly)."""
    key = id(producers)
    if key not in _pairs:
        _pairs.clear()
        producer = producers("dense", 64, PRODUCER_SEED)
        conn, _ = consumers("dense", 64, handshake_timeout_s=1.0, load_timeout_s=10.0)
        _pairs[key] = (producer, conn)
    return _pairs[key]


def test_a_transfer_the_backend_failed_is_reported_with_its_kind_in_the_failure_and_the_metrics(
        producers, consumers, backend) -> None:
    from kvconnect import metrics

    producer = producers("dense", 16, PRODUCER_SEED)
    transport = FaultyTransport(real_transport(backend), fail_poll_after=0)
    conn, _ = consumers("dense", 16, transport=transport)
    before = metrics.value("kvconnect_transfer_errors_total", {"kind": "transfer"})
    conn.start_load(producer.hold("broken", [np.array([1, 2])], tokens=32), [[3, 4]])
    failure = wait_for(conn, ["broken"]).failed["broken"]
    assert (failure.stage, failure.kind) == (Stage.TRANSFER, "transfer"), failure
    assert metrics.value("kvconnect_transfer_errors_total", {"kind": "transfer"}) == before + 1
    assert wait_held(producer) == 0  # the abort notice freed the lease


def wait_held(producer, timeout: float = 10.0) -> int:
    """The producer's held blocks once the abort notice had time to arrive."""
    deadline = time.monotonic() + timeout
    while producer.held_blocks() and time.monotonic() < deadline:
        time.sleep(0.02)
    return producer.held_blocks()
