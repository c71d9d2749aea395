"""The ZMQ side channel: a listener that serves engine metadata (and, given a handler, answers control
messages about leases), the clients that call it, and a directory of known peers.

The listener is the one place kvconnect accepts bytes from the network. It binds loopback unless told
otherwise, speaks only the msgspec schema in `kvconnect.wire`, and treats every incoming message as
hostile: anything that is not a well-formed (and, with a secret, authenticated) request is counted,
logged and dropped, and the listener thread keeps answering. Checks are plain `if`s so that they hold
under `python -O`.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import logging
import math
import os
import threading
import time
from typing import Callable, Iterator

import zmq

from kvconnect import wire
from kvconnect.errors import HandshakeError
from kvconnect.wire import (
    PROTOCOL_VERSION,
    Ack,
    Claim,
    ClaimReply,
    Compat,
    ControlMessage,
    ControlReply,
    EngineMetadata,
    HandshakeRejection,
    HandshakeReply,
    HandshakeRequest,
    ReplyEnvelope,
    RequestEnvelope,
    WireError,
)

logger = logging.getLogger(__name__)

SECRET_ENV = "KVCONNECT_SECRET"

# Timestamps further than this from the listener's clock are refused; nonces are remembered for twice
# as long, which covers every timestamp that could still pass the window.
DEFAULT_MAX_SKEW_S = 30.0
DEFAULT_REPLAY_CACHE_SIZE = 65536

# Frames between MAX_REQUEST_BYTES and this reach the listener and are counted as oversized; larger ones
# make libzmq drop the sender's connection before any of it is buffered in full.
_SOCKET_MAX_MSG_BYTES = 4 * wire.MAX_REQUEST_BYTES
_POLL_MS = 50
_CLOSE_JOIN_S = 1.0

# Returns the metadata of the requested rank; None (or raising LookupError) means "no such rank here".
Provider = Callable[[int], EngineMetadata | None]
# Answers a control message: a ClaimReply to a Claim, an Ack to Done, Abort and Heartbeat.
ControlHandler = Callable[[ControlMessage], ControlReply]

DROP_REASONS = (
    "frame_count",
    "oversized",
    "malformed",
    "version",
    "unauthenticated",
    "stale",
    "replay",
    "busy",
    "unknown_rank",
    "provider_error",
    "unsupported",
    "control_error",
    "internal",
)


def resolve_secret(secret: bytes | str | None = None) -> bytes | None:
    """The shared secret to use: the argument if given, else $KVCONNECT_SECRET, else None."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            return None
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the handshake secret must not be empty")
    return key


def _strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_wildcard(host: str) -> bool:
    bare = _strip_brackets(host)
    if bare in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    bare = _strip_brackets(host)
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def _is_ipv6(host: str) -> bool:
    return ":" in _strip_brackets(host)


def _endpoint(host: str, port: int | str) -> str:
    bare = _strip_brackets(host)
    return f"tcp://[{bare}]:{port}" if _is_ipv6(bare) else f"tcp://{bare}:{port}"


class _ReplayCache:
    """Nonces seen within the freshness window; bounded, and full means refuse (fail closed)."""

    def __init__(self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._clock = clock

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, nonce: bytes) -> str | None:
        """Record a nonce; returns None if it is new, else "replay" or "busy"."""
        now = self._clock()
        # Entries are inserted with a fixed TTL on a monotonic clock, so the oldest expire first.
        while self._seen:
            oldest, expiry = next(iter(self._seen.items()))
            if expiry > now:
                break
            del self._seen[oldest]
        if nonce in self._seen:
            return "replay"
        if len(self._seen) >= self._capacity:
            return "busy"
        self._seen[nonce] = now + self._ttl_s
        return None


class _Drop(Exception):
    # Control flow inside the listener: a message is dropped (counted, logged), maybe with a rejection.
    def __init__(self, reason: str, detail: str, rejection: HandshakeRejection | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.rejection = rejection


class HandshakeServer:
    """Serves this engine's metadata (and control answers) to peers over a ZMQ ROUTER on a daemon thread.

    `provider(rank)` and `control(msg)` run on the listener thread; they should return promptly, since
    the listener answers one message at a time.
    """

    def __init__(
        self,
        provider: Provider,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | str | None = None,
        *,
        allow_wildcard: bool = False,
        control: ControlHandler | None = None,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        replay_cache_size: int = DEFAULT_REPLAY_CACHE_SIZE,
    ) -> None:
        if _is_wildcard(host) and not allow_wildcard:
            raise ValueError(
                f"refusing to bind the handshake listener to the wildcard address {host!r}; "
                "pass allow_wildcard=True to listen on every interface"
            )
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        if not (math.isfinite(max_skew_s) and max_skew_s > 0):
            raise ValueError(f"max_skew_s must be a positive number, got {max_skew_s!r}")
        if replay_cache_size < 1:
            raise ValueError(f"replay_cache_size must be positive, got {replay_cache_size!r}")
        self._provider = provider
        self._control = control
        self._secret = resolve_secret(secret)
        self._max_skew_s = float(max_skew_s)
        self._replay = _ReplayCache(replay_cache_size, 2 * self._max_skew_s)
        self._stats_lock = threading.Lock()
        counters = ("received", "served", "dropped", "rejected", "send_failed", "listener_errors", *DROP_REASONS)
        self._stats: dict[str, int] = dict.fromkeys(counters, 0)
        self._last_log: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _SOCKET_MAX_MSG_BYTES)
            if _is_ipv6(host):
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(_endpoint(host, port if port else "*"))
            endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._ctx.term()
            raise HandshakeError(f"cannot bind the handshake listener to {_endpoint(host, port)}: {exc}") from exc
        self._sock = sock
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.endpoint = endpoint

        if self._secret is None and not _is_loopback(host):
            logger.warning(
                "kvconnect handshake listener on %s is unauthenticated: any host that can reach it can "
                "read this engine's metadata; set %s (or pass secret=) on every worker",
                endpoint,
                SECRET_ENV,
            )

        self._stop = threading.Event()
        # The socket is handed to the thread here and never touched by this one again (ZMQ sockets are
        # not thread-safe); the thread closes it.
        self._thread = threading.Thread(target=self._serve, name=f"kvconnect-handshake-{self.port}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters.

        `received` = `served` + `dropped`; every dropped message is also counted under one reason from
        DROP_REASONS, and `rejected` counts the dropped ones that were answered with a rejection.
        `send_failed` counts answers that could not be queued (the peer had gone or stopped reading),
        `listener_errors` failures outside any one message (the thread carries on after each).
        """
        with self._stats_lock:
            return dict(self._stats)

    @property
    def authenticated(self) -> bool:
        """Whether requests must carry a valid MAC."""
        return self._secret is not None

    def is_alive(self) -> bool:
        """Whether the listener thread is running."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the listener; returns within about a second."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_CLOSE_JOIN_S)

    def __enter__(self) -> HandshakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------

    def _count(self, *keys: str) -> None:
        with self._stats_lock:
            for key in keys:
                self._stats[key] += 1

    def _log_drop(self, reason: str, detail: str, peer: str) -> None:
        # One warning per reason every few seconds: whoever can reach the port must not be able to flood
        # the log. Every drop still gets a debug line.
        now = time.monotonic()
        if now - self._last_log.get(reason, -math.inf) >= 5.0:
            suppressed = self._suppressed.pop(reason, 0)
            more = f" ({suppressed} more since the last report)" if suppressed else ""
            logger.warning("kvconnect handshake: dropped a message from %s: %s: %s%s", peer, reason, detail, more)
            self._last_log[reason] = now
        else:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            logger.debug("kvconnect handshake: dropped a message from %s: %s: %s", peer, reason, detail)

    def _serve(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    if not poller.poll(_POLL_MS):
                        continue
                    for frames, count in self._drain(sock):
                        self._handle(sock, frames, count)
                except Exception:  # noqa: BLE001 - the listener must outlive any single failure
                    self._count("listener_errors")
                    logger.exception("kvconnect handshake: listener error (continuing)")
                    time.sleep(0.01)
        finally:
            sock.close(linger=0)
            self._ctx.term()

    def _drain(self, sock: zmq.Socket) -> Iterator[tuple[list[zmq.Frame], int]]:
        # Bounded batch so that the stop flag is seen even under a steady stream of messages.
        for _ in range(256):
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [frame]
            count = 1
            while frame.more:
                # The rest of a multipart message is already queued (ZMQ delivers messages whole); keep
                # only the two frames a request has, count the others.
                frame = sock.recv(copy=False)
                count += 1
                if count <= 2:
                    frames.append(frame)
            yield frames, count

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame], count: int) -> None:
        self._count("received")
        peer = _peer_address(frames[-1])
        try:
            reply = self._answer(frames, count)
        except _Drop as drop:
            reply = self._refuse(drop, peer)
        except Exception as exc:  # noqa: BLE001 - a bug in one check costs one message, not the listener
            logger.exception("kvconnect handshake: unexpected error handling a message from %s", peer)
            reply = self._refuse(_Drop("internal", repr(exc)), peer)
        else:
            self._count("served")
        if reply is None:
            return
        try:
            sock.send_multipart([frames[0].bytes, reply], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._count("send_failed")
            self._log_drop("send_failed", str(exc), peer)

    def _refuse(self, drop: _Drop, peer: str) -> bytes | None:
        self._count("dropped", drop.reason)
        self._log_drop(drop.reason, drop.detail, peer)
        if drop.rejection is None:
            return None
        self._count("rejected")
        body = wire.encode_reply_body(drop.rejection)
        return wire.encode_reply_envelope(ReplyEnvelope(protocol_version=PROTOCOL_VERSION, body=body))

    def _answer(self, frames: list[zmq.Frame], count: int) -> bytes:
        if count != 2:
            raise _Drop("frame_count", f"expected [identity, request], got {count} frames")
        data = frames[1].buffer
        if data.nbytes > wire.MAX_REQUEST_BYTES:
            raise _Drop("oversized", f"{data.nbytes} bytes, limit {wire.MAX_REQUEST_BYTES}")
        try:
            env = wire.decode_request_envelope(data)
        except WireError as exc:
            version = wire.probe_protocol_version(data, wire.MAX_REQUEST_BYTES)
            if version is not None and version != PROTOCOL_VERSION:
                raise self._version_drop(version) from None
            raise _Drop("malformed", str(exc)) from None
        if env.protocol_version != PROTOCOL_VERSION:
            raise self._version_drop(env.protocol_version)

        if self._secret is not None:
            self._authenticate(env)

        try:
            request = wire.decode_request(env.body)
        except WireError as exc:
            raise _Drop("malformed", str(exc)) from None

        if isinstance(request, HandshakeRequest):
            body = self._metadata_reply(request.rank)
        else:
            body = self._control_reply(request)
        mac = b"" if self._secret is None else wire.reply_mac(self._secret, PROTOCOL_VERSION, env.nonce, body)
        return wire.encode_reply_envelope(ReplyEnvelope(protocol_version=PROTOCOL_VERSION, body=body, mac=mac))

    def _metadata_reply(self, rank: int) -> bytes:
        meta = self._lookup(rank)
        try:
            payload = wire.encode_metadata(meta)
            # Struct constructors do not type-check; decoding our own payload finds a provider bug here,
            # with a log line on this side, instead of as a puzzling "malformed" on every peer.
            wire.decode_metadata(payload)
            return wire.encode_reply_body(HandshakeReply(compat=meta.compat(), payload=payload))
        except Exception as exc:  # noqa: BLE001 - whatever the provider returned, the listener survives
            raise _Drop(
                "provider_error",
                f"invalid metadata for rank {rank}: {exc}",
                HandshakeRejection(reason="internal", detail="the listener could not encode its metadata"),
            ) from None

    def _control_reply(self, msg: ControlMessage) -> bytes:
        if self._control is None:
            raise _Drop(
                "unsupported",
                f"{type(msg).__name__} sent to a listener without a control handler",
                HandshakeRejection(reason="unsupported", detail="this listener serves metadata only"),
            )
        try:
            reply = self._control(msg)
            expected = ClaimReply if isinstance(msg, Claim) else Ack
            if not isinstance(reply, expected):
                raise TypeError(f"returned {type(reply).__name__}, not {expected.__name__}")
            body = wire.encode_reply_body(reply)
            wire.decode_reply_body(body)  # as for metadata: catch an off-schema answer on this side
            return body
        except Exception as exc:  # noqa: BLE001 - a handler bug must not take the listener down
            raise _Drop(
                "control_error",
                f"control handler failed on {type(msg).__name__}: {exc!r}",
                HandshakeRejection(reason="internal", detail="the listener failed to handle the message"),
            ) from None

    def _version_drop(self, version: int) -> _Drop:
        detail = f"listener speaks protocol {PROTOCOL_VERSION}, request uses {version}"
        return _Drop("version", detail, HandshakeRejection(reason="version", detail=detail))

    def _authenticate(self, env: RequestEnvelope) -> None:
        secret = self._secret
        if secret is None:
            return
        if len(env.mac) != wire.MAC_BYTES or len(env.nonce) < wire.NONCE_BYTES:
            raise _Drop(
                "unauthenticated",
                "missing MAC or nonce",
                HandshakeRejection(reason="unauthenticated", detail="request is not authenticated"),
            )
        expected = wire.request_mac(secret, env.protocol_version, env.nonce, env.timestamp, env.body)
        if not hmac.compare_digest(expected, env.mac):
            raise _Drop(
                "unauthenticated",
                "MAC mismatch",
                HandshakeRejection(reason="unauthenticated", detail="request MAC does not verify"),
            )
        skew = env.timestamp - time.time()
        # Written so that a non-finite timestamp fails too (the schema bounds it, this is the backstop).
        if not abs(skew) <= self._max_skew_s:
            raise _Drop(
                "stale",
                f"timestamp {skew:+.1f} s from the listener's clock",
                HandshakeRejection(reason="stale", detail=f"timestamp outside ±{self._max_skew_s:g} s"),
            )
        verdict = self._replay.add(env.nonce)
        if verdict == "replay":
            raise _Drop("replay", "nonce seen before", HandshakeRejection(reason="replay", detail="nonce reused"))
        if verdict is not None:
            raise _Drop("busy", "replay cache full", HandshakeRejection(reason="busy", detail="try again later"))

    def _lookup(self, rank: int) -> EngineMetadata:
        try:
            meta = self._provider(rank)
        except LookupError:
            meta = None
        except Exception as exc:  # noqa: BLE001 - a provider bug must not take the listener down
            raise _Drop(
                "provider_error",
                f"provider raised for rank {rank}: {exc!r}",
                HandshakeRejection(reason="internal", detail="the listener failed to produce metadata"),
            ) from None
        if meta is None:
            raise _Drop(
                "unknown_rank",
                f"no metadata for rank {rank}",
                HandshakeRejection(reason="unknown_rank", detail=f"no rank {rank} here"),
            )
        if not isinstance(meta, EngineMetadata) or meta.rank != rank:
            raise _Drop(
                "provider_error",
                f"provider returned {type(meta).__name__} for rank {rank}",
                HandshakeRejection(reason="internal", detail="the listener failed to produce metadata"),
            )
        return meta


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return "unknown peer"


# --------------------------------------------------------------------------------------------------
# Client

_ctx_lock = threading.Lock()
_ctx: tuple[int, zmq.Context] | None = None


def _client_context() -> zmq.Context:
    # One context per process: creating one per fetch costs an I/O thread each time. After a fork the
    # inherited context is unusable (its I/O thread did not survive), so the child makes its own.
    global _ctx
    pid = os.getpid()
    with _ctx_lock:
        if _ctx is None or _ctx[0] != pid:
            _ctx = (pid, zmq.Context())
        return _ctx[1]


def fetch_metadata(
    host: str,
    port: int,
    *,
    rank: int = 0,
    timeout: float = 5.0,
    secret: bytes | str | None = None,
    expect: Compat | None = None,
) -> EngineMetadata:
    """Fetch a peer's metadata for `rank`; raises HandshakeError within `timeout` (plus a few ms)."""
    if not (isinstance(rank, int) and 0 <= rank <= 65535):
        raise ValueError(f"rank must be an integer in [0, 65535], got {rank!r}")
    body, endpoint = _call(host, port, HandshakeRequest(rank=rank), timeout=timeout, secret=secret)
    if not isinstance(body, HandshakeReply):
        raise HandshakeError(f"malformed reply from {endpoint}: {type(body).__name__} to a metadata request")

    # Phase two: the fingerprint is checked before a byte of the payload is decoded.
    if body.compat.protocol_version != PROTOCOL_VERSION:
        raise _version_error(endpoint, body.compat.protocol_version)
    if expect is not None:
        wire.check_compat(expect, body.compat)
    try:
        meta = wire.decode_metadata(body.payload)
    except WireError as exc:
        raise HandshakeError(f"malformed metadata from {endpoint}: {exc}") from None
    if meta.compat() != body.compat:
        raise HandshakeError(f"malformed reply from {endpoint}: metadata disagree with their fingerprint")
    if meta.rank != rank:
        raise HandshakeError(f"malformed reply from {endpoint}: asked for rank {rank}, got rank {meta.rank}")
    return meta


def send_control(
    host: str,
    port: int,
    msg: Claim | wire.Done | wire.Abort | wire.Heartbeat,
    *,
    timeout: float = 5.0,
    secret: bytes | str | None = None,
) -> ClaimReply | Ack:
    """Send a control message to a peer's listener; its ClaimReply (to a Claim) or Ack, or HandshakeError."""
    if not isinstance(msg, (Claim, wire.Done, wire.Abort, wire.Heartbeat)):
        raise TypeError(f"not a control message: {type(msg).__name__}")
    body, endpoint = _call(host, port, msg, timeout=timeout, secret=secret)
    expected = ClaimReply if isinstance(msg, Claim) else Ack
    if not isinstance(body, expected):
        raise HandshakeError(
            f"malformed reply from {endpoint}: {type(body).__name__} to {type(msg).__name__}"
        )
    return body


def _call(
    host: str,
    port: int,
    request: HandshakeRequest | ControlMessage,
    *,
    timeout: float,
    secret: bytes | str | None,
) -> tuple[HandshakeReply | ClaimReply | Ack, str]:
    # One request, one reply, one deadline: connect, send, wait, then phase one of reading the reply.
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    key = resolve_secret(secret)
    endpoint = _endpoint(host, port)
    deadline = time.monotonic() + timeout

    body = wire.encode_request(request)
    nonce = wire.new_nonce()
    timestamp = time.time()
    mac = b"" if key is None else wire.request_mac(key, PROTOCOL_VERSION, nonce, timestamp, body)
    data = wire.encode_request_envelope(
        RequestEnvelope(protocol_version=PROTOCOL_VERSION, body=body, nonce=nonce, timestamp=timestamp, mac=mac)
    )

    sock = _client_context().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing until the connection is up, so a send that times out means "could not connect".
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REPLY_BYTES + 4096)
        if _is_ipv6(host):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise HandshakeError(f"cannot connect to {endpoint}: {exc}") from None
        sock.setsockopt(zmq.SNDTIMEO, _remaining_ms(deadline))
        try:
            sock.send(data)
        except zmq.Again:
            raise HandshakeError(
                f"no connection to {endpoint} within {timeout:g} s (nothing listening, refused or unreachable)"
            ) from None
        if not sock.poll(_remaining_ms(deadline), zmq.POLLIN):
            raise HandshakeError(f"{endpoint} did not answer within {timeout:g} s")
        frame = sock.recv(copy=False)
        if frame.more:
            raise HandshakeError(f"malformed reply from {endpoint}: more than one frame")
    finally:
        sock.close(linger=0)
    return _open_reply(frame.buffer, endpoint=endpoint, nonce=nonce, key=key), endpoint


def _remaining_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


def _open_reply(
    data: memoryview, *, endpoint: str, nonce: bytes, key: bytes | None
) -> HandshakeReply | ClaimReply | Ack:
    # Phase one: envelope, version, MAC, and the kind of answer. Rejections raise here.
    try:
        env = wire.decode_reply_envelope(data)
    except WireError as exc:
        version = wire.probe_protocol_version(data)
        if version is not None and version != PROTOCOL_VERSION:
            raise _version_error(endpoint, version) from None
        raise HandshakeError(f"malformed reply from {endpoint}: {exc}") from None
    if env.protocol_version != PROTOCOL_VERSION:
        raise _version_error(endpoint, env.protocol_version)

    mac_ok = False
    if key is not None and env.mac:
        expected = wire.reply_mac(key, env.protocol_version, nonce, env.body)
        if not hmac.compare_digest(expected, env.mac):
            raise HandshakeError(f"reply from {endpoint} fails authentication (different secret?)")
        mac_ok = True

    try:
        body = wire.decode_reply_body(env.body)
    except WireError as exc:
        raise HandshakeError(f"malformed reply from {endpoint}: {exc}") from None
    if isinstance(body, HandshakeRejection):
        # Unsigned rejections are believed: all they can do is make this call fail.
        detail = f": {body.detail}" if body.detail else ""
        raise HandshakeError(f"{endpoint} rejected the request ({body.reason}){detail}")
    if key is not None and not mac_ok:
        raise HandshakeError(
            f"reply from {endpoint} is not authenticated (is the listener configured with the secret?)"
        )
    return body


def _version_error(endpoint: str, version: int) -> HandshakeError:
    return wire.IncompatiblePeerError(
        f"incompatible peer at {endpoint} (protocol_version differs): ours {PROTOCOL_VERSION}, peer's {version}",
        (("protocol_version", PROTOCOL_VERSION, version),),
    )


# --------------------------------------------------------------------------------------------------
# Peer directory


class PeerDirectory:
    """Metadata of known peers keyed by (engine id, rank), replaced on a new incarnation, expiring after a TTL."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number, got {ttl_s!r}")
        self._ttl_s = float(ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, int], tuple[EngineMetadata, float]] = {}

    def put(self, meta: EngineMetadata) -> bool:
        """Store or refresh a peer; True when the transport must (re-)add it (new peer or new incarnation)."""
        key = (meta.engine_id, meta.rank)
        now = self._clock()
        with self._lock:
            old = self._entries.get(key)
            fresh = old is not None and old[1] > now
            self._entries[key] = (meta, now + self._ttl_s)
        return not (fresh and old is not None and old[0].incarnation == meta.incarnation)

    def get(self, engine_id: str, rank: int = 0) -> EngineMetadata | None:
        """The cached metadata of a peer, or None if unknown or expired."""
        with self._lock:
            entry = self._entries.get((engine_id, rank))
            if entry is None:
                return None
            if entry[1] <= self._clock():
                del self._entries[(engine_id, rank)]
                return None
            return entry[0]

    def remove(self, engine_id: str, rank: int = 0) -> EngineMetadata | None:
        """Forget a peer; returns what was cached."""
        with self._lock:
            entry = self._entries.pop((engine_id, rank), None)
        return None if entry is None else entry[0]

    def expire(self) -> list[EngineMetadata]:
        """Drop expired entries and return them, so the transport can release those peers."""
        now = self._clock()
        with self._lock:
            gone = [key for key, (_, expiry) in self._entries.items() if expiry <= now]
            return [self._entries.pop(key)[0] for key in gone]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


__all__ = [
    "DROP_REASONS",
    "SECRET_ENV",
    "ControlHandler",
    "HandshakeServer",
    "PeerDirectory",
    "Provider",
    "fetch_metadata",
    "resolve_secret",
    "send_control",
]
