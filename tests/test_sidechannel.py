"""The ZMQ side channel: the listener survives anything, the client never hangs, auth means auth."""

from __future__ import annotations

import logging
import os
import pathlib
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from typing import Callable, Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import free_port, msgpack_values
from kvconnect import HandshakeError, wire
from kvconnect.compat import IncompatiblePeerError, check_compat, layers_digest
from kvconnect.sidechannel import SECRET_ENV, SideChannelServer, call, fetch_metadata, metadata_handler, resolve_secret
from kvconnect.sidechannel.auth import ReplayCache, new_nonce, request_mac
from kvconnect.wire import EngineMetadata, RegionMeta

SECRET = b"correct horse battery staple, 32b"
# Liveness bound, not a performance figure: how much past its timeout a failing fetch may return.
MARGIN_S = 1.5
WORLD_SIZE = 2


def make_metadata(rank: int = 0, **overrides: object) -> EngineMetadata:
    fields = dict(
        engine_id="prefill-0",
        incarnation="a" * 32,
        rank=rank,
        world_size=WORLD_SIZE,
        transport="nixl",
        transport_metadata=b"agent-blob-" + bytes([rank]),
        regions=(
            RegionMeta(
                names=("model.layers.0.attn",),
                base_addr=0x7F00_0000_0000 + rank * (1 << 32),
                num_blocks=64,
                block_bytes=8192,
                block_stride=8192,
                device_id=rank,
                memory_kind="VRAM",
            ),
        ),
        group_regions=((0,),),
        block_size=16,
        layout="LBHNC",
        dtype="bfloat16",
    )
    fields.update(overrides)
    fields.setdefault("compat", compat_of(fields))
    return EngineMetadata(**fields)


def compat_of(fields: dict) -> wire.Compat:
    """The compatibility fingerprint metadata with these fields carry."""
    group = wire.GroupCompat(label="attention", block_size=fields["block_size"], page_bytes=(8192,),
                             layers=layers_digest([("model.layers.0.attn",)]))
    return wire.Compat(transport=fields["transport"], layout=fields["layout"], dtype=fields["dtype"],
                       block_size=fields["block_size"], groups=(group,))


def serve(provide=None, *, control=None, **kw) -> SideChannelServer:
    """A listener serving `provide(rank)` (default: the test provider) and, given one, a control handler."""
    return SideChannelServer(metadata_handler(provide or provider, control), **kw)


def provider(rank: int) -> EngineMetadata | None:
    return make_metadata(rank) if 0 <= rank < WORLD_SIZE else None


@pytest.fixture(autouse=True)
def _no_ambient_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    with serve() as srv:
        yield srv


@pytest.fixture
def auth_server() -> Iterator[SideChannelServer]:
    with serve(secret=SECRET) as srv:
        yield srv


@pytest.fixture(scope="module")
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def exchange(ctx: zmq.Context, port: int, frames: list[bytes], timeout: float = 3.0) -> bytes | None:
    """Send raw frames from a fresh DEALER; the reply frame, or None if none came within `timeout`."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(frames)
        if sock.poll(int(timeout * 1000), zmq.POLLIN):
            return sock.recv()
        return None
    finally:
        sock.close(linger=0)


def signed_request(
    secret: bytes | None,
    *,
    rank: int = 0,
    nonce: bytes | None = None,
    timestamp: float | None = None,
    body: bytes | None = None,
    version: int = wire.PROTOCOL_VERSION,
) -> tuple[bytes, bytes]:
    """A request envelope built by hand (so tests can make it stale, replayed, or carry any body)."""
    nonce = new_nonce() if nonce is None else nonce
    timestamp = time.time() if timestamp is None else timestamp
    body = wire.REQUEST.encode(wire.HandshakeRequest(rank=rank)) if body is None else body
    mac = b"" if secret is None else request_mac(secret, version, nonce, timestamp, body)
    env = wire.RequestEnvelope(protocol_version=version, body=body, nonce=nonce, timestamp=timestamp, mac=mac)
    return msgspec.msgpack.encode(env), nonce


def reply_body(data: bytes) -> wire.HandshakeReply | wire.HandshakeRejection:
    return wire.REPLY.decode(wire.REPLY_ENVELOPE.decode(data).body)



def assert_serves(srv: SideChannelServer, secret: bytes | None = None) -> None:
    meta = fetch_metadata("127.0.0.1", srv.port, rank=1, timeout=5.0, secret=secret)
    assert meta == make_metadata(1)
    assert srv.is_alive()


# --------------------------------------------------------------------------------------------------
# The happy path and the listener's lifecycle


def test_fetch_returns_the_providers_metadata_for_each_rank(server: SideChannelServer) -> None:
    for rank in range(WORLD_SIZE):
        meta = fetch_metadata("127.0.0.1", server.port, rank=rank, timeout=5.0)
        assert meta == make_metadata(rank)
    assert server.stats["served"] == WORLD_SIZE


def test_fetch_with_matching_expectation_succeeds(server: SideChannelServer) -> None:
    meta = fetch_metadata("127.0.0.1", server.port, timeout=5.0, expect=make_metadata(0).compat)
    assert meta.engine_id == "prefill-0"


def test_port_zero_binds_a_free_loopback_port() -> None:
    with serve() as a, serve() as b:
        assert a.port > 0 and b.port > 0 and a.port != b.port
        assert a.endpoint == f"tcp://127.0.0.1:{a.port}"


def test_listener_binds_an_explicit_port() -> None:
    port = free_port()
    with serve(port=port) as srv:
        assert srv.port == port
        assert_serves(srv)


def test_close_returns_within_a_second_and_frees_the_port() -> None:
    srv = serve()
    assert_serves(srv)
    t0 = time.monotonic()
    srv.close()
    assert time.monotonic() - t0 < 1.0 + MARGIN_S
    assert not srv.is_alive()
    srv.close()  # idempotent
    with serve(port=srv.port) as again:
        assert_serves(again)


def test_binding_a_busy_port_raises_handshake_error(server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match="cannot bind"):
        serve(port=server.port)


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", "[::]", "", "0:0:0:0:0:0:0:0"])
def test_wildcard_bind_is_refused_without_opt_in(host: str) -> None:
    with pytest.raises(ValueError, match="allow_wildcard"):
        serve(host=host)


def test_wildcard_bind_with_opt_in_warns_that_it_is_unauthenticated(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvconnect.sidechannel.server"):
        with serve(host="0.0.0.0", allow_wildcard=True) as srv:
            assert_serves(srv)
    assert any("unauthenticated" in r.getMessage() for r in caplog.records)


def test_authenticated_or_loopback_listeners_do_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvconnect.sidechannel.server"):
        with serve(host="0.0.0.0", allow_wildcard=True, secret=SECRET):
            pass
        with serve():
            pass
    assert not [r for r in caplog.records if "unauthenticated" in r.getMessage()]


def test_ipv6_loopback_works_where_available() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        srv = serve(host="::1")
    except HandshakeError:
        pytest.skip("IPv6 loopback unavailable")
    with srv:
        assert fetch_metadata("::1", srv.port, timeout=5.0) == make_metadata(0)


# --------------------------------------------------------------------------------------------------
# Whatever arrives, the listener drops it, counts it and goes on


def _pickled_marker(path: pathlib.Path) -> bytes:
    class WritesMarker:
        def __reduce__(self):
            return (open, (str(path), "w"))

    return pickle.dumps(WritesMarker())


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"a", b"b"], "frame_count"),
        ([b"a", b"b", b"c", b"d", b"e"], "frame_count"),
        ([b"\x00" * 10], "malformed"),
        ([os.urandom(64)], "malformed"),
        ([b"\xc1"], "malformed"),  # the one byte msgpack never uses
        ([msgspec.msgpack.encode([1, 2, 3])], "malformed"),
        ([msgspec.msgpack.encode({"rank": 0})], "malformed"),
        ([msgspec.msgpack.encode({"protocol_version": wire.PROTOCOL_VERSION, "body": "not bytes"})], "malformed"),
        ([msgspec.msgpack.encode({"protocol_version": wire.PROTOCOL_VERSION, "body": b"\x81\xa4rank\xa1x"})], "malformed"),
        ([b"\x91" * 4000], "malformed"),  # deeply nested arrays
        ([b"\x00" * (wire.MAX_REQUEST_BYTES + 1)], "oversized"),
        ([b"\x00" * (2 * wire.MAX_REQUEST_BYTES)], "oversized"),
    ],
)
def test_listener_drops_bad_frames_and_keeps_serving(
    server: SideChannelServer, zctx: zmq.Context, frames: list[bytes], reason: str
) -> None:
    assert exchange(zctx, server.port, frames, timeout=0.3) is None
    assert wait_for(lambda: server.stats[reason] == 1)
    assert_serves(server)
    stats = server.stats
    assert stats["dropped"] == 1 and stats["served"] == 1 and stats["rejected"] == 0


def test_listener_survives_a_frame_past_the_socket_limit(server: SideChannelServer, zctx: zmq.Context) -> None:
    # libzmq cuts the sender off before the message is buffered; nothing reaches the handler.
    assert exchange(zctx, server.port, [b"\x00" * (1 << 20)], timeout=0.3) is None
    assert_serves(server)
    assert server.stats["received"] == 1


def test_pickle_payloads_are_never_deserialized(
    auth_server: SideChannelServer, server: SideChannelServer, zctx: zmq.Context, tmp_path: pathlib.Path
) -> None:
    marker = tmp_path / "marker"
    payload = _pickled_marker(marker)
    pickle.loads(_pickled_marker(tmp_path / "control"))  # the payload does what it says when unpickled
    assert (tmp_path / "control").exists()

    exchange(zctx, server.port, [payload], timeout=0.2)
    exchange(zctx, server.port, [signed_request(None, body=payload)[0]], timeout=0.2)
    # Authenticated, so it reaches the body decoder of an authenticated listener.
    exchange(zctx, auth_server.port, [signed_request(SECRET, body=payload)[0]], timeout=0.2)
    with pytest.raises(wire.WireError):
        wire.REQUEST.decode(payload)
    assert wait_for(lambda: server.stats["malformed"] == 2 and auth_server.stats["malformed"] == 1)
    assert_serves(server)
    assert_serves(auth_server, secret=SECRET)
    assert not marker.exists()


def test_unknown_rank_is_rejected_promptly_and_counted(server: SideChannelServer) -> None:
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="unknown_rank"):
        fetch_metadata("127.0.0.1", server.port, rank=7, timeout=5.0)
    assert time.monotonic() - t0 < 5.0
    assert server.stats["unknown_rank"] == 1
    assert_serves(server)


@pytest.mark.parametrize(
    "bad_provider",
    [
        lambda rank: 1 / 0,
        lambda rank: {"engine_id": "not a struct"},
        lambda rank: make_metadata(0 if rank else 1),  # the wrong rank
        lambda rank: make_metadata(rank, transport_metadata="str, not bytes"),
        lambda rank: make_metadata(rank, transport_metadata=object()),
    ],
    ids=["raises", "wrong_type", "wrong_rank", "off_schema", "unencodable"],
)
def test_provider_failures_are_reported_and_do_not_kill_the_listener(bad_provider) -> None:
    calls = []

    def flaky(rank: int) -> EngineMetadata | None:
        calls.append(rank)
        return provider(rank) if rank == 1 else bad_provider(rank)

    with serve(flaky) as srv:
        with pytest.raises(HandshakeError, match="internal"):
            fetch_metadata("127.0.0.1", srv.port, rank=0, timeout=5.0)
        assert srv.stats["handler_error"] == 1
        assert_serves(srv)


def test_request_from_another_protocol_version_gets_a_version_rejection(
    server: SideChannelServer, zctx: zmq.Context
) -> None:
    future = msgspec.msgpack.encode({"protocol_version": wire.PROTOCOL_VERSION + 1, "hello": [1, 2]})
    reply = exchange(zctx, server.port, [future])
    assert reply is not None
    body = reply_body(reply)
    assert isinstance(body, wire.HandshakeRejection) and body.reason == "version"
    assert server.stats["version"] == 1


# --------------------------------------------------------------------------------------------------
# Fuzzing the listener

_valid_request = signed_request(None)[0]


@st.composite
def _mutated_request(draw: st.DrawFn) -> bytes:
    data = bytearray(_valid_request)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


_envelope_like = st.fixed_dictionaries(
    {"protocol_version": st.one_of(st.just(wire.PROTOCOL_VERSION), msgpack_values)},
    optional={
        "body": st.one_of(msgpack_values.map(msgspec.msgpack.encode), st.binary(max_size=40), msgpack_values),
        "nonce": st.one_of(st.binary(max_size=80), msgpack_values),
        "timestamp": st.one_of(st.floats(), msgpack_values),
        "mac": st.one_of(st.binary(max_size=80), msgpack_values),
        "rank": msgpack_values,
    },
).map(msgspec.msgpack.encode)

_VALID_BODIES = [
    msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
    for msg in (
        wire.HandshakeRequest(rank=1),
        wire.Claim(engine_id="decode-0", rank=0, request_ids=("r1", "r2"), need_s=3.0, incarnation="inc-1"),
        wire.Done(engine_id="decode-0", rank=0, request_ids=("r1",)),
        wire.Abort(engine_id="decode-0", rank=0, request_ids=("r1",), reason="x"),
        wire.Heartbeat(engine_id="decode-0", rank=0, request_ids=("r1",)),
    )
]
_field_values = st.one_of(
    msgpack_values,
    st.integers(min_value=-5, max_value=70_000),
    st.text(max_size=300),
    st.lists(st.text(max_size=200), max_size=300),
    st.floats(),
)


@st.composite
def _near_valid_body(draw: st.DrawFn) -> bytes:
    """A valid request body of any kind with up to two fields dropped, replaced or added."""
    fields = dict(draw(st.sampled_from(_VALID_BODIES)))
    count = draw(st.sampled_from([0, 0, 1, 1, 2]))
    for name in draw(st.lists(st.sampled_from([*fields, "extra"]), min_size=count, max_size=count, unique=True)):
        if draw(st.booleans()):
            fields.pop(name, None)
        else:
            fields[name] = draw(_field_values)
    return msgspec.msgpack.encode(fields)


_payloads = st.one_of(
    st.binary(max_size=128),
    msgpack_values.map(msgspec.msgpack.encode),
    _envelope_like,
    _mutated_request(),
    st.integers(wire.MAX_REQUEST_BYTES - 2, 3 * wire.MAX_REQUEST_BYTES).map(lambda n: b"\x82" * n),
    st.just(pickle.dumps({"a": [1, 2, 3]})),
    _near_valid_body().map(lambda body: signed_request(None, body=body)[0]),
)
# Mostly single frames (the shape of a request), so that most cases get past the frame count.
_frames = st.one_of(*[_payloads.map(lambda payload: [payload])] * 3, st.lists(_payloads, min_size=2, max_size=4))

_FUZZ = settings(
    max_examples=2000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _fuzz(srv: SideChannelServer, zctx: zmq.Context, strategy: st.SearchStrategy, examples: int) -> int:
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{srv.port}")
    sent = [0]

    @settings(_FUZZ, max_examples=examples)
    @given(frames=strategy)
    def send(frames: list[bytes]) -> None:
        sock.send_multipart(frames)
        sent[0] += 1
        while sock.poll(0, zmq.POLLIN):  # drain rejections so they never pile up
            sock.recv_multipart()

    try:
        send()
    finally:
        sock.close(linger=0)
    return sent[0]


def test_fuzzed_frames_never_stop_the_listener(server: SideChannelServer, zctx: zmq.Context) -> None:
    sent = _fuzz(server, zctx, _frames, 2000)
    assert wait_for(lambda: server.stats["received"] >= sent)
    assert_serves(server)
    stats = server.stats
    assert stats["received"] == sent + 1
    assert stats["served"] + stats["dropped"] == stats["received"]
    assert stats["internal"] == 0 and stats["listener_errors"] == 0
    for reason in ("frame_count", "malformed", "oversized"):
        assert stats[reason] > 0, stats


def test_fuzzed_requests_never_pass_authentication(auth_server: SideChannelServer, zctx: zmq.Context) -> None:
    sent = _fuzz(auth_server, zctx, st.one_of(_envelope_like, _mutated_request()).map(lambda b: [b]), 800)
    assert wait_for(lambda: auth_server.stats["received"] >= sent)
    stats = auth_server.stats
    assert stats["served"] == 0, stats
    assert stats["internal"] == 0 and stats["listener_errors"] == 0
    assert_serves(auth_server, secret=SECRET)


def test_fuzzed_bodies_behind_a_valid_mac_never_stop_the_listener(zctx: zmq.Context) -> None:
    bodies = st.one_of(st.binary(max_size=64), msgpack_values.map(msgspec.msgpack.encode), *[_near_valid_body()] * 4)
    with serve(secret=SECRET, control=Recorder()) as srv:
        sent = _fuzz(srv, zctx, bodies.map(lambda body: [signed_request(SECRET, body=body)[0]]), 800)
        assert wait_for(lambda: srv.stats["received"] >= sent)
        stats = srv.stats
        assert stats["unauthenticated"] == 0 and stats["internal"] == 0 and stats["listener_errors"] == 0, stats
        assert stats["handler_error"] == 0
        assert stats["malformed"] > 0 and stats["served"] > 0  # garbage was refused, valid messages served
        assert_serves(srv, secret=SECRET)


# --------------------------------------------------------------------------------------------------
# Control messages share the listener, its limits and its authentication


class Recorder:
    """A control handler that grants every claim and reports every named request as live."""

    def __init__(self) -> None:
        self.seen: list[msgspec.Struct] = []

    def __call__(self, msg: wire.ControlMessage) -> wire.ReplyBody:
        self.seen.append(msg)
        if isinstance(msg, wire.Claim):
            return wire.ClaimReply(granted_s={rid: 30.0 for rid in msg.request_ids[1:]},
                                   refused={rid: "expired" for rid in msg.request_ids[:1]}, incarnation="inc-1")
        return wire.Ack(live=msg.request_ids)


def _claim(*ids: str) -> wire.Claim:
    return wire.Claim(engine_id="decode-0", rank=0, request_ids=ids, need_s=5.0, incarnation="inc-1")


def test_control_messages_reach_the_handler_and_come_back_answered() -> None:
    handler = Recorder()
    with serve(control=handler, secret=SECRET) as srv:
        reply = call("127.0.0.1", srv.port, _claim("old", "new"), timeout=5.0, secret=SECRET)
        assert reply == wire.ClaimReply(granted_s={"new": 30.0}, refused={"old": "expired"}, incarnation="inc-1")
        for note in (
            wire.Done(engine_id="decode-0", rank=0, request_ids=("new",)),
            wire.Abort(engine_id="decode-0", rank=0, request_ids=("new",), reason="gave up"),
            wire.Heartbeat(engine_id="decode-0", rank=0, request_ids=("a", "b")),
        ):
            assert call("127.0.0.1", srv.port, note, timeout=5.0, secret=SECRET) == wire.Ack(
                live=note.request_ids
            )
        assert fetch_metadata("127.0.0.1", srv.port, timeout=5.0, secret=SECRET) == make_metadata(0)
        assert [type(m).__name__ for m in handler.seen] == ["Claim", "Done", "Abort", "Heartbeat"]
        assert srv.stats["served"] == 5


def test_control_messages_without_a_handler_are_rejected(server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match="unsupported"):
        call("127.0.0.1", server.port, _claim("r"), timeout=5.0)
    assert server.stats["unsupported"] == 1
    assert_serves(server)


def test_unauthenticated_control_messages_never_reach_the_handler() -> None:
    handler = Recorder()
    with serve(control=handler, secret=SECRET) as srv:
        for secret in (None, b"wrong"):
            with pytest.raises(HandshakeError, match="unauthenticated"):
                call("127.0.0.1", srv.port, _claim("r"), timeout=5.0, secret=secret)
    assert handler.seen == []


@pytest.mark.parametrize(
    "bad_handler",
    [
        lambda msg: 1 / 0,
        lambda msg: wire.Ack(),  # an Ack where a ClaimReply belongs
        lambda msg: wire.ClaimReply(granted_s={"r": float("nan")}, incarnation="inc-1"),  # off the schema
        lambda msg: None,
    ],
    ids=["raises", "wrong_kind", "off_schema", "none"],
)
def test_control_handler_failures_are_reported_and_do_not_kill_the_listener(bad_handler) -> None:
    with serve(control=bad_handler) as srv:
        with pytest.raises(HandshakeError, match="internal"):
            call("127.0.0.1", srv.port, _claim("r"), timeout=5.0)
        assert srv.stats["handler_error"] == 1
        assert_serves(srv)


def test_call_refuses_what_is_not_a_request() -> None:
    with pytest.raises(TypeError):
        call("127.0.0.1", 1, wire.Ack(), timeout=1.0)


def test_control_reply_of_the_wrong_kind_is_malformed(zctx: zmq.Context) -> None:
    frames = [_reply(wire.Ack(live=("r",)))]
    with _fake_listener(zctx, lambda request: frames) as port:
        with pytest.raises(HandshakeError, match="malformed"):
            call("127.0.0.1", port, _claim("r"), timeout=5.0)
        with pytest.raises(HandshakeError, match="malformed"):
            fetch_metadata("127.0.0.1", port, timeout=5.0)


# --------------------------------------------------------------------------------------------------
# Authentication


@pytest.mark.parametrize(
    ("client_secret", "outcome"),
    [
        (None, "unauthenticated"),
        (b"not the secret", "unauthenticated"),
        (SECRET, None),
        (SECRET.decode(), None),  # a str secret is its UTF-8 bytes
    ],
    ids=["no_secret", "wrong_secret", "good_secret", "good_secret_str"],
)
def test_auth_matrix(auth_server: SideChannelServer, client_secret: bytes | str | None, outcome: str | None) -> None:
    if outcome is None:
        assert fetch_metadata("127.0.0.1", auth_server.port, timeout=5.0, secret=client_secret) == make_metadata(0)
        assert auth_server.stats["served"] == 1
    else:
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match=outcome):
            fetch_metadata("127.0.0.1", auth_server.port, timeout=5.0, secret=client_secret)
        assert time.monotonic() - t0 < 5.0  # a rejection, not a timeout
        assert auth_server.stats[outcome] == 1 and auth_server.stats["served"] == 0


@pytest.mark.parametrize("offset_s", [-120.0, 120.0], ids=["old", "future"])
def test_stale_timestamps_are_rejected(auth_server: SideChannelServer, zctx: zmq.Context, offset_s: float) -> None:
    request, _ = signed_request(SECRET, timestamp=time.time() + offset_s)
    body = reply_body(exchange(zctx, auth_server.port, [request]))
    assert isinstance(body, wire.HandshakeRejection) and body.reason == "stale"
    assert auth_server.stats["stale"] == 1 and auth_server.stats["served"] == 0


def test_replayed_nonce_is_rejected(auth_server: SideChannelServer, zctx: zmq.Context) -> None:
    request, _ = signed_request(SECRET)
    first = reply_body(exchange(zctx, auth_server.port, [request]))
    assert isinstance(first, wire.HandshakeReply)
    second = reply_body(exchange(zctx, auth_server.port, [request]))
    assert isinstance(second, wire.HandshakeRejection) and second.reason == "replay"
    assert auth_server.stats["replay"] == 1 and auth_server.stats["served"] == 1


def test_tampered_body_fails_the_mac(auth_server: SideChannelServer, zctx: zmq.Context) -> None:
    request, _ = signed_request(SECRET, rank=0)
    env = wire.REQUEST_ENVELOPE.decode(request)
    forged = msgspec.structs.replace(env, body=wire.REQUEST.encode(wire.HandshakeRequest(rank=1)))
    body = reply_body(exchange(zctx, auth_server.port, [msgspec.msgpack.encode(forged)]))
    assert isinstance(body, wire.HandshakeRejection) and body.reason == "unauthenticated"


def test_rejections_carry_nothing_but_the_reason(auth_server: SideChannelServer, zctx: zmq.Context) -> None:
    reply = exchange(zctx, auth_server.port, [signed_request(None)[0]])
    assert b"prefill-0" not in reply and b"agent-blob" not in reply
    env = wire.REPLY_ENVELOPE.decode(reply)
    assert isinstance(wire.REPLY.decode(env.body), wire.HandshakeRejection)


def test_client_with_secret_refuses_an_unauthenticated_listener(server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match="not authenticated"):
        fetch_metadata("127.0.0.1", server.port, timeout=5.0, secret=SECRET)


def test_replayed_reply_fails_the_clients_check(auth_server: SideChannelServer, zctx: zmq.Context) -> None:
    # Record a genuine reply to someone else's nonce, then serve it from an impostor listener.
    recorded = exchange(zctx, auth_server.port, [signed_request(SECRET)[0]])
    assert isinstance(reply_body(recorded), wire.HandshakeReply)
    with _fake_listener(zctx, lambda request: [recorded]) as port:
        with pytest.raises(HandshakeError, match="authentication"):
            fetch_metadata("127.0.0.1", port, timeout=5.0, secret=SECRET)


def test_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    assert resolve_secret() == SECRET
    assert resolve_secret(b"explicit") == b"explicit"
    with serve() as srv:
        assert srv.authenticated
        assert fetch_metadata("127.0.0.1", srv.port, timeout=5.0) == make_metadata(0)
        with pytest.raises(HandshakeError, match="unauthenticated"):
            fetch_metadata("127.0.0.1", srv.port, timeout=5.0, secret=b"explicit and wrong")


def test_empty_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        resolve_secret(b"")
    assert resolve_secret(None) is None


def test_replay_cache_forgets_after_its_window_and_fails_closed_when_full() -> None:
    now = [0.0]
    cache = ReplayCache(capacity=2, ttl_s=60.0, clock=lambda: now[0])
    assert cache.add(b"a") is None
    assert cache.add(b"a") == "replay"
    assert cache.add(b"b") is None
    assert cache.add(b"c") == "busy"
    now[0] = 61.0
    assert cache.add(b"c") is None
    assert len(cache) == 1
    assert cache.add(b"a") is None  # its timestamp could no longer pass the freshness check anyway


# --------------------------------------------------------------------------------------------------
# The client never hangs


class _fake_listener:
    """A ROUTER that answers each request with whatever `respond` returns (None: never answers)."""

    def __init__(self, ctx: zmq.Context, respond: Callable[[bytes], list[bytes] | None]) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._respond = respond
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(20, zmq.POLLIN):
                identity, request = self._sock.recv_multipart()
                frames = self._respond(request)
                if frames is not None:
                    self._sock.send_multipart([identity, *frames])
        self._sock.close(linger=0)

    def __enter__(self) -> int:
        self._thread.start()
        return self.port

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2.0)


def _assert_fails_in_time(port: int, match: str, timeout: float = 0.5, **kwargs: object) -> HandshakeError:
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match=match) as info:
        fetch_metadata("127.0.0.1", port, timeout=timeout, **kwargs)
    assert time.monotonic() - t0 < timeout + MARGIN_S
    return info.value


def test_fetch_from_a_port_where_nothing_listens_fails_within_its_deadline() -> None:
    _assert_fails_in_time(free_port(), "no connection")


def test_fetch_from_a_listener_that_never_answers_fails_within_its_deadline(zctx: zmq.Context) -> None:
    with _fake_listener(zctx, lambda request: None) as port:
        _assert_fails_in_time(port, "did not answer")


def test_fetch_from_a_plain_tcp_server_fails_within_its_deadline() -> None:
    # Accepts the connection but never speaks ZMTP.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        _assert_fails_in_time(listener.getsockname()[1], "no connection")


def _reply(body: msgspec.Struct, version: int = wire.PROTOCOL_VERSION, mac: bytes = b"") -> bytes:
    return msgspec.msgpack.encode(
        wire.ReplyEnvelope(protocol_version=version, body=msgspec.msgpack.encode(body), mac=mac)
    )


def _answer(payload: EngineMetadata | bytes) -> bytes:
    """A reply carrying rank 0's fingerprint around `payload`."""
    if isinstance(payload, EngineMetadata):
        payload = msgspec.msgpack.encode(payload)
    return _reply(wire.HandshakeReply(compat=make_metadata(0).compat, payload=payload))


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([b"\x00garbage"], "malformed"),
        ([pickle.dumps(make_metadata(0))], "malformed"),
        ([_reply(make_metadata(0))], "malformed"),  # metadata where a reply body belongs
        ([_answer(b"\x00")], "malformed metadata"),
        ([_answer(make_metadata(1))], "rank"),
        ([_answer(make_metadata(0, dtype="float16"))], "fingerprint"),
        ([_answer(make_metadata(0)), b"extra"], "more than one frame"),
    ],
    ids=["garbage", "pickle", "wrong_shape", "bad_payload", "wrong_rank", "lying_fingerprint", "two_frames"],
)
def test_malformed_replies_raise_handshake_error(zctx: zmq.Context, frames: list[bytes], match: str) -> None:
    with _fake_listener(zctx, lambda request: frames) as port:
        _assert_fails_in_time(port, match, timeout=5.0)


def test_reply_from_another_protocol_version_names_the_version(zctx: zmq.Context) -> None:
    future = msgspec.msgpack.encode({"protocol_version": wire.PROTOCOL_VERSION + 1, "body": [1, 2], "new": True})
    with _fake_listener(zctx, lambda request: [future]) as port:
        err = _assert_fails_in_time(port, "protocol_version", timeout=5.0)
    assert isinstance(err, IncompatiblePeerError)
    assert str(wire.PROTOCOL_VERSION + 1) in str(err)


def test_incompatibility_is_found_before_the_payload_is_decoded(zctx: zmq.Context) -> None:
    # The payload is garbage: an error naming block_size proves the fingerprint was checked first.
    compat = make_metadata(0, block_size=32).compat
    frames = [_reply(wire.HandshakeReply(compat=compat, payload=b"\xc1 not metadata"))]
    with _fake_listener(zctx, lambda request: frames) as port:
        _assert_fails_in_time(port, "block_size", timeout=5.0, expect=make_metadata(0).compat)


def test_incompatible_listener_is_reported_field_by_field() -> None:
    def other(rank: int) -> EngineMetadata:
        return make_metadata(rank, block_size=32, dtype="float8_e4m3fn")

    with serve(other) as srv:
        with pytest.raises(IncompatiblePeerError) as info:
            fetch_metadata("127.0.0.1", srv.port, timeout=5.0, expect=make_metadata(0).compat)
    message = str(info.value)
    assert "block_size" in message and "16" in message and "32" in message
    assert "dtype" in message and "float8_e4m3fn" in message
    assert "layout" not in message


def test_fetch_validates_its_arguments() -> None:
    for timeout in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            fetch_metadata("127.0.0.1", 1, timeout=timeout)
    with pytest.raises(ValueError):
        fetch_metadata("127.0.0.1", 1, rank=-1, timeout=1.0)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_fetches_leave_no_socket_behind(server: SideChannelServer) -> None:
    dead_port = free_port()
    fetch_metadata("127.0.0.1", server.port, timeout=5.0)  # warm the client context
    before = _open_fds()
    for _ in range(40):
        fetch_metadata("127.0.0.1", server.port, timeout=5.0)
    for _ in range(5):
        with pytest.raises(HandshakeError):
            fetch_metadata("127.0.0.1", dead_port, timeout=0.05)
    with pytest.raises(HandshakeError):
        fetch_metadata("127.0.0.1", server.port, rank=9, timeout=5.0)
    # libzmq closes connections on its I/O thread, a moment after the socket is closed.
    assert wait_for(lambda: _open_fds() <= before + 2), (before, _open_fds())


# --------------------------------------------------------------------------------------------------
# Many peers at once


def test_call_many_answers_each_peer_alone_within_one_deadline() -> None:
    from kvconnect.sidechannel import Target, call_many

    dead = free_port()
    beat = wire.Heartbeat(engine_id="decode-0", rank=0, request_ids=("r",))
    with serve(control=Recorder()) as live, serve(control=Recorder()) as other:
        targets = [Target("127.0.0.1", live.port, beat), Target("127.0.0.1", dead, beat),
                   Target("127.0.0.1", other.port, wire.HandshakeRequest(rank=1))]
        t0 = time.monotonic()
        results = call_many(targets, timeout=1.0)
        assert time.monotonic() - t0 < 1.0 + MARGIN_S
    assert results[0] == wire.Ack(live=("r",))
    assert isinstance(results[1], HandshakeError) and "no connection" in str(results[1])
    assert isinstance(results[2], wire.HandshakeReply)


def test_a_caller_paused_past_the_connect_bound_still_takes_a_connection_that_came_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The caller's thread is not scheduled between opening the socket and its first look: by the time
    # it looks, the connect bound has passed on its clock, yet the connection is up and must be used.
    from kvconnect.sidechannel import client

    real = time.monotonic
    calls = []

    def paused() -> float:
        calls.append(None)
        if len(calls) == 2:
            time.sleep(0.3)
        return real() + (0.0 if len(calls) == 1 else 2.0)

    beat = wire.Heartbeat(engine_id="decode-0", rank=0, request_ids=("r",))
    with serve(control=Recorder()) as live:
        monkeypatch.setattr(client, "time", types.SimpleNamespace(monotonic=paused, time=time.time))
        reply = call("127.0.0.1", live.port, beat, timeout=30.0, connect_timeout=1.0)
    assert reply == wire.Ack(live=("r",))


# --------------------------------------------------------------------------------------------------
# Under python -O

_OPTIMIZED_SCRIPT = textwrap.dedent(
    """
    import sys, time, zmq, msgspec
    try:
        assert False
    except AssertionError:
        sys.exit("not running under -O")
    from kvconnect import HandshakeError, wire
    from kvconnect.compat import check_compat
    from kvconnect.sidechannel import SideChannelServer, fetch_metadata, metadata_handler

    def check(ok, what):
        if not ok:
            sys.exit("FAILED: " + what)

    group = wire.GroupCompat(label="kv", block_size=16, page_bytes=(64,), layers="x")
    compat = wire.Compat(transport="t", layout="LBHNC", dtype="bfloat16", block_size=16, groups=(group,))
    region = wire.RegionMeta(names=("l",), base_addr=4096, num_blocks=4, block_bytes=64, block_stride=64,
                             device_id=0, memory_kind="DRAM")
    meta = wire.EngineMetadata(engine_id="e", incarnation="i", rank=0, world_size=1, transport="t",
                               regions=(region,), group_regions=((0,),), block_size=16, layout="LBHNC",
                               dtype="bfloat16", compat=compat)
    secret = b"s" * 32
    with SideChannelServer(metadata_handler(lambda rank: meta if rank == 0 else None)) as plain, \\
         SideChannelServer(metadata_handler(lambda rank: meta), secret=secret) as auth:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect("tcp://127.0.0.1:%d" % plain.port)
        for frames in ([b"x"], [b"a", b"b"], [b"\\x00" * 100000], [msgspec.msgpack.encode({"rank": 0})],
                       [msgspec.msgpack.encode({"protocol_version": wire.PROTOCOL_VERSION, "body": b"\\xc1"})]):
            sock.send_multipart(frames)
        deadline = time.monotonic() + 10
        while plain.stats["dropped"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = plain.stats
        check(stats["dropped"] == 5, "drops counted: %r" % stats)
        check(stats["frame_count"] == 1 and stats["oversized"] == 1 and stats["malformed"] == 3, repr(stats))
        check(fetch_metadata("127.0.0.1", plain.port, timeout=5) == meta, "plain fetch")
        for rank, secret_, reason in ((1, None, "unknown_rank"), (0, None, "unauthenticated"),
                                      (0, b"wrong", "unauthenticated")):
            port = plain.port if reason == "unknown_rank" else auth.port
            try:
                fetch_metadata("127.0.0.1", port, rank=rank, timeout=5, secret=secret_)
                check(False, reason + " accepted")
            except HandshakeError as exc:
                check(reason in str(exc), str(exc))
        check(fetch_metadata("127.0.0.1", auth.port, timeout=5, secret=secret) == meta, "auth fetch")
        try:
            check_compat(meta.compat, wire.Compat(transport="t", layout="LBHNC", dtype="fp8", block_size=16,
                                                       groups=(group,)))
            check(False, "incompatible accepted")
        except HandshakeError as exc:
            check("dtype" in str(exc), str(exc))
        try:
            SideChannelServer(metadata_handler(lambda rank: meta), host="0.0.0.0")
            check(False, "wildcard accepted")
        except ValueError:
            pass
        sock.close(linger=0)
        ctx.term()
    check(not plain.is_alive() and not auth.is_alive(), "listeners stopped")
    print("ok")
    """
)


def test_checks_hold_under_python_dash_o() -> None:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    result = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMIZED_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
