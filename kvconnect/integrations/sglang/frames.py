"""The control frames the kvconnect SGLang backend adds to SGLang's ZMQ sockets, built and parsed here.

Decode -> prefill: `register` (once per prefill rank; pull needs no decode pointers, so it names only
the decode's return address) and `meta` (per request: where to send the params, how many decode
ranks to wait for). Prefill -> decode: `params` (the kvconnect `TransferParams` of a held request).
Nothing read off a socket is trusted: every field is checked, a bad frame parses to None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection

from kvconnect import wire

log = logging.getLogger(__name__)

REGISTER = b"KVCONNECT_REGISTER"
META = b"KVCONNECT_META"
PARAMS = b"KVCONNECT_PARAMS"
STATUS = b"KVCONNECT_STATUS"  # SGLang's status frames, tagged so they never parse as ours
_MAX_ROOM = 2**64 - 1
_MAX_HOST = 255
_MAX_PEERS = 4096


@dataclass(frozen=True)
class Meta:
    """A decode rank's request: its return address, and how many decode ranks the prefill waits for."""

    room: int
    host: str
    port: int
    required: int
    prefix_len: int
    dummy: bool


def _int(frame: bytes, lo: int, hi: int) -> int:
    value = int(frame.decode("ascii"))
    if not lo <= value <= hi:
        raise ValueError(f"{value} outside [{lo}, {hi}]")
    return value


def _host(frame: bytes) -> str:
    host = frame.decode("ascii")
    if not host or len(host) > _MAX_HOST or any(c.isspace() for c in host):
        raise ValueError(f"bad host {host[:40]!r}")
    return host


def register(host: str, port: int) -> list[bytes]:
    """Decode -> prefill, once per prefill rank."""
    return [REGISTER, host.encode("ascii"), str(port).encode("ascii")]


def meta(m: Meta) -> list[bytes]:
    """Decode -> prefill, per request."""
    return [META, str(m.room).encode("ascii"), m.host.encode("ascii"), str(m.port).encode("ascii"),
            str(m.required).encode("ascii"), str(m.prefix_len).encode("ascii"), b"1" if m.dummy else b"0"]


def parse_meta(msg: list[bytes]) -> Meta | None:
    """A `meta` frame, or None (logged) when malformed."""
    try:
        if len(msg) != 7 or msg[6] not in (b"0", b"1"):
            raise ValueError(f"{len(msg)} frames")
        return Meta(room=_int(msg[1], 0, _MAX_ROOM), host=_host(msg[2]), port=_int(msg[3], 1, 65535),
                    required=_int(msg[4], 1, _MAX_PEERS), prefix_len=_int(msg[5], 0, 2**31), dummy=msg[6] == b"1")
    except (ValueError, UnicodeDecodeError) as exc:
        log.warning("kvconnect sglang: dropping a malformed request frame: %s", exc)
        return None


def params(room: int, rank: int, p: wire.TransferParams) -> list[bytes]:
    """Prefill -> decode: the params of a held request."""
    return [PARAMS, str(room).encode("ascii"), str(rank).encode("ascii"), wire.TRANSFER_PARAMS.encode(p)]


def parse_params(msg: list[bytes]) -> tuple[int, int, wire.TransferParams] | None:
    """(room, prefill rank, params) of a `params` frame, or None (logged) when malformed."""
    try:
        if len(msg) != 4:
            raise ValueError(f"{len(msg)} frames")
        return _int(msg[1], 0, _MAX_ROOM), _int(msg[2], 0, _MAX_PEERS), wire.TRANSFER_PARAMS.decode(msg[3])
    except (ValueError, UnicodeDecodeError, wire.WireError) as exc:
        log.warning("kvconnect sglang: dropping malformed transfer params: %s", exc)
        return None


def foreign_hosts(p: wire.TransferParams, bootstrapped: Collection[str]) -> list[str]:
    """The hosts `p` names for the producer's ranks that SGLang's bootstrap did not name for the room: params
    from anyone else would send the decode to read another host's bytes into the request's pages."""
    return sorted({p.host, *(r.host for r in p.ranks)} - set(bootstrapped))
