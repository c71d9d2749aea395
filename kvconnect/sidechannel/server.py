"""The side-channel listener: one ZMQ ROUTER on a daemon thread, answering metadata and control requests.

This is the one place kvconnect accepts bytes from the network. It binds loopback unless told
otherwise, speaks only the msgspec schema in `kvconnect.wire`, and treats every incoming message as
hostile: anything that is not a well-formed (and, with a secret, authenticated) request is counted,
logged and dropped, and the thread keeps answering. Checks are plain `if`s so that they hold under
`python -O`. What a request means is the handler's business (`Handler`); the listener only checks
that the handler's answer is of the type that request gets (`wire.REPLY_TYPE`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Iterator

import zmq

from kvconnect import wire
from kvconnect.errors import HandshakeError
from kvconnect.sidechannel.addresses import check_bind, is_ipv6, is_loopback, zmq_endpoint
from kvconnect.threads import spawn, zmq_context
from kvconnect.sidechannel.auth import (
    DEFAULT_MAX_SKEW_S,
    DEFAULT_REPLAY_CACHE_SIZE,
    SECRET_ENV,
    RequestVerifier,
    reply_mac,
    resolve_secret,
)
from kvconnect.wire import PROTOCOL_VERSION, HandshakeRejection, ReplyEnvelope, WireError

logger = logging.getLogger(__name__)

# Frames between MAX_REQUEST_BYTES and this reach the listener and are counted as oversized; larger ones
# make libzmq drop the sender's connection before any of it is buffered in full.
_SOCKET_MAX_MSG_BYTES = 4 * wire.MAX_REQUEST_BYTES
_POLL_MS = 50
_CLOSE_JOIN_S = 1.0
_LOG_EVERY_S = 5.0

DROP_REASONS = ("frame_count", "oversized", "malformed", "version", "unauthenticated", "stale", "replay", "busy",
                "unknown_rank", "refused", "unsupported", "handler_error", "internal")


class Refusal(Exception):
    """Raised by a handler (or the listener's checks) to refuse a request: counted, logged, maybe answered."""

    def __init__(self, reason: str, detail: str, answer: wire.RejectionReason | None = None,
                 told: str | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail
        self.rejection = None if answer is None else HandshakeRejection(reason=answer, detail=told or detail)


# Answers one decoded request with a reply body of `wire.REPLY_TYPE[type(request)]`, or raises Refusal.
Handler = Callable[[wire.RequestBody], wire.ReplyBody]


def metadata_handler(provider: Callable[[int], wire.EngineMetadata | None],
                     control: Callable[[wire.ControlMessage], wire.ReplyBody] | None = None) -> Handler:
    """A handler serving `provider(rank)` metadata, and control messages to `control` when given."""

    def handle(request: wire.RequestBody) -> wire.ReplyBody:
        if isinstance(request, wire.HandshakeRequest):
            meta = provider(request.rank)
            if meta is None:
                raise Refusal("unknown_rank", f"no metadata for rank {request.rank}", "unknown_rank",
                              f"no rank {request.rank} here")
            if meta.rank != request.rank:
                raise Refusal("handler_error", f"provider returned rank {meta.rank} for rank {request.rank}",
                              "internal", "the listener failed to produce metadata")
            return wire.metadata_reply(meta)
        if control is None:
            raise Refusal("unsupported", f"{type(request).__name__} sent to a metadata-only listener", "unsupported",
                          "this listener serves metadata only")
        return control(request)

    return handle


class _Counters:
    """Thread-safe counters of what the listener received, served and dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        names = ("received", "served", "dropped", "rejected", "send_failed", "listener_errors", *DROP_REASONS)
        self._values = dict.fromkeys(names, 0)

    def add(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._values[key] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class SideChannelServer:
    """Answers side-channel requests with `handler` on a daemon thread.

    The handler runs on the listener thread and should return promptly: the listener answers one
    message at a time.
    """

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 secret: bytes | str | None = None, *, allow_wildcard: bool = False,
                 max_skew_s: float = DEFAULT_MAX_SKEW_S, replay_cache_size: int = DEFAULT_REPLAY_CACHE_SIZE) -> None:
        check_bind(host, allow_wildcard=allow_wildcard)
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        if not (math.isfinite(max_skew_s) and max_skew_s > 0):
            raise ValueError(f"max_skew_s must be a positive number, got {max_skew_s!r}")
        if replay_cache_size < 1:
            raise ValueError(f"replay_cache_size must be positive, got {replay_cache_size!r}")
        self._handler = handler
        self._secret = resolve_secret(secret)
        self._verifier = None if self._secret is None else RequestVerifier(self._secret, max_skew_s, replay_cache_size)
        self._counters = _Counters()
        self._last_log: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._ctx = zmq_context()
        self._sock, self.endpoint = self._bind(host, port)
        self.host = host
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        if self._secret is None and not is_loopback(host):
            logger.warning("kvconnect side channel on %s is unauthenticated: any host that can reach it can read "
                           "this engine's metadata; set %s (or pass secret=) on every worker", self.endpoint, SECRET_ENV)
        self._stop = threading.Event()
        # The socket is handed to the thread here and never touched by this one again (ZMQ sockets are
        # not thread-safe); the thread closes it.
        self._thread = spawn(self._serve, name=f"kvconnect-sidechannel-{self.port}")

    def _bind(self, host: str, port: int) -> tuple[zmq.Socket, str]:
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _SOCKET_MAX_MSG_BYTES)
            if is_ipv6(host):
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(zmq_endpoint(host, port if port else "*"))
            return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._ctx.term()
            raise HandshakeError(f"cannot bind the side channel to {zmq_endpoint(host, port)}: {exc}") from exc

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters.

        `received` = `served` + `dropped`; every dropped message is also counted under one reason from
        DROP_REASONS, and `rejected` counts the dropped ones that were answered with a rejection.
        `send_failed` counts answers that could not be queued (the peer had gone or stopped reading),
        `listener_errors` failures outside any one message (the thread carries on after each).
        """
        return self._counters.snapshot()

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

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the listener thread ----

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
                    self._counters.add("listener_errors")
                    logger.exception("kvconnect side channel: listener error (continuing)")
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
            frames, count = [frame], 1
            while frame.more:
                # The rest of a multipart message is already queued (ZMQ delivers messages whole); keep
                # only the two frames a request has, count the others.
                frame = sock.recv(copy=False)
                count += 1
                if count <= 2:
                    frames.append(frame)
            yield frames, count

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame], count: int) -> None:
        self._counters.add("received")
        peer = _peer_address(frames[-1])
        try:
            reply = self._answer(frames, count)
        except Refusal as refusal:
            reply = self._refuse(refusal, peer)
        except Exception as exc:  # noqa: BLE001 - a bug in one check costs one message, not the listener
            logger.exception("kvconnect side channel: unexpected error handling a message from %s", peer)
            reply = self._refuse(Refusal("internal", repr(exc), "internal", "the listener failed"), peer)
        else:
            self._counters.add("served")
        if reply is None:
            return
        try:
            sock.send_multipart([frames[0].bytes, reply], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._counters.add("send_failed")
            self._log_drop("send_failed", str(exc), peer)

    def _refuse(self, refusal: Refusal, peer: str) -> bytes | None:
        self._counters.add("dropped", refusal.reason)
        self._log_drop(refusal.reason, refusal.detail, peer)
        if refusal.rejection is None:
            return None
        self._counters.add("rejected")
        body = wire.REPLY.encode(refusal.rejection)
        return wire.REPLY_ENVELOPE.encode(ReplyEnvelope(protocol_version=PROTOCOL_VERSION, body=body))

    def _log_drop(self, reason: str, detail: str, peer: str) -> None:
        # One warning per reason every few seconds: whoever can reach the port must not be able to flood
        # the log. Every drop still gets a debug line.
        now = time.monotonic()
        if now - self._last_log.get(reason, -math.inf) >= _LOG_EVERY_S:
            suppressed = self._suppressed.pop(reason, 0)
            more = f" ({suppressed} more since the last report)" if suppressed else ""
            logger.warning("kvconnect side channel: dropped a message from %s: %s: %s%s", peer, reason, detail, more)
            self._last_log[reason] = now
        else:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            logger.debug("kvconnect side channel: dropped a message from %s: %s: %s", peer, reason, detail)

    def _answer(self, frames: list[zmq.Frame], count: int) -> bytes:
        if count != 2:
            raise Refusal("frame_count", f"expected [identity, request], got {count} frames")
        data = frames[1].buffer
        if data.nbytes > wire.MAX_REQUEST_BYTES:
            raise Refusal("oversized", f"{data.nbytes} bytes, limit {wire.MAX_REQUEST_BYTES}")
        try:
            env = wire.REQUEST_ENVELOPE.decode(data)
        except WireError as exc:
            version = wire.probe_protocol_version(data)
            if version is not None and version != PROTOCOL_VERSION:
                raise _version_refusal(version) from None
            raise Refusal("malformed", str(exc)) from None
        if env.protocol_version != PROTOCOL_VERSION:
            raise _version_refusal(env.protocol_version)
        if self._verifier is not None:
            failed = self._verifier.check(env.protocol_version, env.nonce, env.timestamp, env.body, env.mac)
            if failed is not None:
                reason, detail, told = failed
                raise Refusal(reason, detail, reason, told)
        try:
            request = wire.REQUEST.decode(env.body)
        except WireError as exc:
            raise Refusal("malformed", str(exc)) from None
        body = self._reply_body(request)
        mac = b"" if self._secret is None else reply_mac(self._secret, PROTOCOL_VERSION, env.nonce, body)
        return wire.REPLY_ENVELOPE.encode(ReplyEnvelope(protocol_version=PROTOCOL_VERSION, body=body, mac=mac))

    def _reply_body(self, request: wire.RequestBody) -> bytes:
        expected = wire.REPLY_TYPE[type(request)]
        try:
            reply = self._handler(request)
            if not isinstance(reply, expected):
                raise TypeError(f"returned {type(reply).__name__}, not {expected.__name__}")
            body = wire.REPLY.encode(reply)
            wire.REPLY.decode(body)  # an off-schema answer is caught here, not on every peer
            return body
        except Refusal:
            raise
        except Exception as exc:  # noqa: BLE001 - a handler bug must not take the listener down
            raise Refusal("handler_error", f"handler failed on {type(request).__name__}: {exc!r}", "internal",
                          "the listener failed to handle the message") from None


def _version_refusal(version: int) -> Refusal:
    detail = f"listener speaks protocol {PROTOCOL_VERSION}, request uses {version}"
    return Refusal("version", detail, "version")


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return "unknown peer"
