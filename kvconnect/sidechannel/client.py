"""Side-channel clients: one request, one reply, one deadline; or many requests to many peers at once.

Every call returns or raises `HandshakeError` within its timeout (plus a few milliseconds). Two
bounds: `connect_timeout` for the connection to come up (nothing listening, a dead host or a stopped
process fail here), `timeout` for the whole call (a peer that took the request and is slow to answer
gets until then). A reply is opened in two phases: envelope, version, MAC and kind first; a metadata
payload is decoded only after its compatibility fingerprint matched what the caller expects.
"""

from __future__ import annotations

import hmac
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import zmq

from kvconnect import compat, wire
from kvconnect.errors import HandshakeError
from kvconnect.sidechannel.addresses import is_ipv6, zmq_endpoint
from kvconnect.sidechannel.auth import new_nonce, reply_mac, request_mac, resolve_secret
from kvconnect.threads import zmq_context
from kvconnect.wire import PROTOCOL_VERSION, HandshakeRejection, RequestEnvelope, WireError

_ctx_lock = threading.Lock()
_ctx: tuple[int, zmq.Context] | None = None


def _client_context() -> zmq.Context:
    # One context per process: creating one per call costs an I/O thread each time. After a fork the
    # inherited context is unusable (its I/O thread did not survive), so the child makes its own.
    global _ctx
    pid = os.getpid()
    with _ctx_lock:
        if _ctx is None or _ctx[0] != pid:
            _ctx = (pid, zmq_context())
        return _ctx[1]


@dataclass(frozen=True)
class Target:
    """One request of `call_many`: where to send it and what."""

    host: str
    port: int
    message: wire.RequestBody


def call(host: str, port: int, message: wire.RequestBody, *, timeout: float = 5.0,
         secret: bytes | str | None = None, connect_timeout: float | None = None) -> wire.ReplyBody:
    """Send one request; its reply of the type `wire.REPLY_TYPE` names, or HandshakeError in `timeout`."""
    result = call_many([Target(host, port, message)], timeout=timeout, secret=secret,
                       connect_timeout=connect_timeout)[0]
    if isinstance(result, HandshakeError):
        raise result
    return result


def fetch_metadata(host: str, port: int, *, rank: int = 0, timeout: float = 5.0,
                   secret: bytes | str | None = None, expect: wire.Compat | None = None,
                   connect_timeout: float | None = None) -> wire.EngineMetadata:
    """Fetch a peer's metadata for `rank`; raises HandshakeError within `timeout` (plus a few ms)."""
    if not (isinstance(rank, int) and 0 <= rank <= 65535):
        raise ValueError(f"rank must be an integer in [0, 65535], got {rank!r}")
    reply = call(host, port, wire.HandshakeRequest(rank=rank), timeout=timeout, secret=secret,
                 connect_timeout=connect_timeout)
    return open_metadata(reply, zmq_endpoint(host, port), rank, expect)


def open_metadata(reply: wire.HandshakeReply, endpoint: str, rank: int,
                  expect: wire.Compat | None) -> wire.EngineMetadata:
    """Phase two of a metadata reply: the fingerprint is checked before a byte of the payload is decoded."""
    if reply.compat.protocol_version != PROTOCOL_VERSION:
        raise _version_error(endpoint, reply.compat.protocol_version)
    if expect is not None:
        compat.check_compat(expect, reply.compat)
    try:
        meta = wire.METADATA.decode(reply.payload)
    except WireError as exc:
        raise HandshakeError(f"malformed metadata from {endpoint}: {exc}") from None
    if meta.compat != reply.compat:
        raise HandshakeError(f"malformed reply from {endpoint}: metadata disagree with their fingerprint")
    if meta.rank != rank:
        raise HandshakeError(f"malformed reply from {endpoint}: asked for rank {rank}, got rank {meta.rank}")
    return meta


def call_many(targets: Sequence[Target], *, timeout: float = 5.0, secret: bytes | str | None = None,
              connect_timeout: float | None = None) -> list[wire.ReplyBody | HandshakeError]:
    """Send every request at once and wait for all replies together, within one `timeout`.

    Each result is the reply or the HandshakeError of that target alone: a dead or silent peer costs
    the others nothing but the shared deadline. A target not connected within `connect_timeout`
    (default: `timeout`) fails then.
    """
    for name, value in (("timeout", timeout), ("connect_timeout", timeout if connect_timeout is None
                                                 else connect_timeout)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    for t in targets:
        if type(t.message) not in wire.REPLY_TYPE:
            raise TypeError(f"not a side-channel request: {type(t.message).__name__}")
    key = resolve_secret(secret)
    start = time.monotonic()
    deadline = start + timeout
    connected_by = start + min(timeout, timeout if connect_timeout is None else connect_timeout)
    pending: dict[zmq.Socket, tuple[int, str, bytes, bytes]] = {}
    results: list[wire.ReplyBody | HandshakeError | None] = [None] * len(targets)
    try:
        for i, t in enumerate(targets):
            endpoint = zmq_endpoint(t.host, t.port)
            try:
                sock, nonce, data = _connect(t, endpoint, key)
            except HandshakeError as exc:
                results[i] = exc
                continue
            pending[sock] = (i, endpoint, nonce, data)
        _collect(pending, results, targets, key, (start, connected_by, deadline))
    finally:
        for sock in pending:
            sock.close(linger=0)
    return results  # type: ignore[return-value]


def _connect(target: Target, endpoint: str, key: bytes | None) -> tuple[zmq.Socket, bytes, bytes]:
    """A connecting socket for one request, the request's nonce and its encoded envelope."""
    try:
        body = wire.REQUEST.encode(target.message)
    except WireError as exc:
        raise HandshakeError(f"cannot send to {endpoint}: {exc}") from None
    nonce, timestamp = new_nonce(), time.time()
    mac = b"" if key is None else request_mac(key, PROTOCOL_VERSION, nonce, timestamp, body)
    data = wire.REQUEST_ENVELOPE.encode(
        RequestEnvelope(protocol_version=PROTOCOL_VERSION, body=body, nonce=nonce, timestamp=timestamp, mac=mac))
    sock = _client_context().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        # Nothing is queued until the connection is up: a send still queued at the deadline means "could
        # not connect". ZMQ keeps trying to connect in the background meanwhile.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REPLY_BYTES + 4096)
        if is_ipv6(target.host):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise HandshakeError(f"cannot connect to {endpoint}: {exc}") from None
    return sock, nonce, data


def _collect(pending: dict, results: list, targets: Sequence[Target], key: bytes | None,
             bounds: tuple[float, float, float]) -> None:
    """Send each request once its connection is up, then read the replies, until the bounds pass."""
    start, connected_by, deadline = bounds
    unsent, waiting = set(pending), set()
    poller = zmq.Poller()
    for sock in pending:
        poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
    while unsent or waiting:
        now = time.monotonic()
        wake = min(connected_by, deadline) if unsent else deadline
        # A bound is judged only after one more look at the sockets: a caller that was not scheduled for
        # a while (a loaded host, a long hold of the GIL) must not fail a connection that came up meanwhile.
        for sock, events in poller.poll(max(1, int((wake - now) * 1000)) if now < wake else 0):
            if sock in unsent and events & zmq.POLLOUT:
                sock.send(pending[sock][3], zmq.NOBLOCK)
                unsent.discard(sock)
                waiting.add(sock)
                poller.modify(sock, zmq.POLLIN)
            elif sock in waiting and events & zmq.POLLIN:
                waiting.discard(sock)
                poller.unregister(sock)
                i, endpoint, nonce, _ = pending[sock]
                results[i] = _read_reply(sock, endpoint, nonce, key, targets[i].message)
        if unsent and now >= connected_by:
            for sock in unsent:
                i, endpoint = pending[sock][:2]
                results[i] = HandshakeError(f"no connection to {endpoint} within {connected_by - start:g} s "
                                            "(nothing listening, refused, unreachable or stopped)")
                poller.unregister(sock)
            unsent = set()
        if now >= deadline:
            break
    for sock in waiting:
        i, endpoint = pending[sock][:2]
        results[i] = HandshakeError(f"{endpoint} did not answer within {deadline - start:g} s")


def _read_reply(sock: zmq.Socket, endpoint: str, nonce: bytes, key: bytes | None,
                message: wire.RequestBody) -> wire.ReplyBody | HandshakeError:
    try:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        if frame.more:
            return HandshakeError(f"malformed reply from {endpoint}: more than one frame")
        body = _open_reply(frame.buffer, endpoint, nonce, key)
    except HandshakeError as exc:
        return exc
    except zmq.ZMQError as exc:
        return HandshakeError(f"reading the reply from {endpoint} failed: {exc}")
    expected = wire.REPLY_TYPE[type(message)]
    if not isinstance(body, expected):
        return HandshakeError(f"malformed reply from {endpoint}: {type(body).__name__} to {type(message).__name__}")
    return body


def _open_reply(data: memoryview, endpoint: str, nonce: bytes, key: bytes | None) -> wire.ReplyBody:
    # Phase one: envelope, version, MAC, and the kind of answer. Rejections raise here.
    try:
        env = wire.REPLY_ENVELOPE.decode(data)
    except WireError as exc:
        version = wire.probe_protocol_version(data)
        if version is not None and version != PROTOCOL_VERSION:
            raise _version_error(endpoint, version) from None
        raise HandshakeError(f"malformed reply from {endpoint}: {exc}") from None
    if env.protocol_version != PROTOCOL_VERSION:
        raise _version_error(endpoint, env.protocol_version)
    mac_ok = False
    if key is not None and env.mac:
        if not hmac.compare_digest(reply_mac(key, env.protocol_version, nonce, env.body), env.mac):
            raise HandshakeError(f"reply from {endpoint} fails authentication (different secret?)")
        mac_ok = True
    try:
        body = wire.REPLY.decode(env.body)
    except WireError as exc:
        raise HandshakeError(f"malformed reply from {endpoint}: {exc}") from None
    if isinstance(body, HandshakeRejection):
        # Unsigned rejections are believed: all they can do is make this call fail.
        detail = f": {body.detail}" if body.detail else ""
        raise HandshakeError(f"{endpoint} rejected the request ({body.reason}){detail}")
    if key is not None and not mac_ok:
        raise HandshakeError(f"reply from {endpoint} is not authenticated (is the listener configured with the secret?)")
    return body


def _version_error(endpoint: str, version: int) -> HandshakeError:
    return compat.IncompatiblePeerError(
        f"incompatible peer at {endpoint} (protocol_version differs): ours {PROTOCOL_VERSION}, peer's {version}",
        (("protocol_version", PROTOCOL_VERSION, version),))
