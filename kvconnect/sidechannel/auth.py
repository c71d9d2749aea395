"""Side-channel authentication: the shared secret, request and reply MACs, and the replay window.

With a secret, every request carries an HMAC-SHA256 over protocol version, nonce, timestamp and body;
the listener checks the MAC, a timestamp window and that the nonce is new. Replies carry a MAC bound
to the request's nonce, so a client can trust what it reads and a recorded reply cannot be replayed.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import struct
import time
from typing import Callable

SECRET_ENV = "KVCONNECT_SECRET"
NONCE_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size

# Timestamps further than this from the listener's clock are refused; nonces are remembered for twice
# as long, which covers every timestamp that could still pass the window.
DEFAULT_MAX_SKEW_S = 30.0
DEFAULT_REPLAY_CACHE_SIZE = 65536

_REQUEST_MAC_DOMAIN = b"kvconnect handshake request\x00"
_REPLY_MAC_DOMAIN = b"kvconnect handshake reply\x00"


def resolve_secret(secret: bytes | str | None = None) -> bytes | None:
    """The shared secret to use: the argument if given, else $KVCONNECT_SECRET, else None."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            return None
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the side-channel secret must not be empty")
    return key


def new_nonce() -> bytes:
    """A fresh random request nonce."""
    return os.urandom(NONCE_BYTES)


def request_mac(secret: bytes, protocol_version: int, nonce: bytes, timestamp: float, body: bytes) -> bytes:
    """HMAC-SHA256 of a request over protocol version, nonce, timestamp and body."""
    # Lengths are framed explicitly so that no two (nonce, body) splits share a MAC input.
    head = struct.pack(">IHd", protocol_version, len(nonce), timestamp)
    return hmac.new(secret, _REQUEST_MAC_DOMAIN + head + nonce + body, hashlib.sha256).digest()


def reply_mac(secret: bytes, protocol_version: int, request_nonce: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of a reply body, bound to the nonce of the request it answers."""
    head = struct.pack(">IH", protocol_version, len(request_nonce))
    return hmac.new(secret, _REPLY_MAC_DOMAIN + head + request_nonce + body, hashlib.sha256).digest()


class ReplayCache:
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


class RequestVerifier:
    """The listener's checks of one authenticated request: MAC, timestamp window, fresh nonce."""

    def __init__(self, secret: bytes, max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 replay_cache_size: int = DEFAULT_REPLAY_CACHE_SIZE) -> None:
        self.secret = secret
        self.max_skew_s = max_skew_s
        self._replay = ReplayCache(replay_cache_size, 2 * max_skew_s)

    def check(self, protocol_version: int, nonce: bytes, timestamp: float, body: bytes,
              mac: bytes) -> tuple[str, str, str] | None:
        """None when the request is authentic, else (reason, log detail, detail told to the sender)."""
        if len(mac) != MAC_BYTES or len(nonce) < NONCE_BYTES:
            return "unauthenticated", "missing MAC or nonce", "request is not authenticated"
        expected = request_mac(self.secret, protocol_version, nonce, timestamp, body)
        if not hmac.compare_digest(expected, mac):
            return "unauthenticated", "MAC mismatch", "request MAC does not verify"
        skew = timestamp - time.time()
        # Written so that a non-finite timestamp fails too (the schema bounds it, this is the backstop).
        if not abs(skew) <= self.max_skew_s:
            return "stale", f"timestamp {skew:+.1f} s from the listener's clock", \
                f"timestamp outside ±{self.max_skew_s:g} s"
        verdict = self._replay.add(nonce)
        if verdict == "replay":
            return "replay", "nonce seen before", "nonce reused"
        if verdict is not None:
            return "busy", "replay cache full", "try again later"
        return None
