"""Transports move registered KV blocks between workers: `Transport` is the interface, one module per backend.

Backends import their library only when their module is imported (`kvconnect.transport.nixl`);
`options` validates each backend's options without importing it, and `make_transport` builds one by name.
"""

from __future__ import annotations

from typing import Any, Mapping

import msgspec

from kvconnect.transport.base import OPS, TransferState, Transport
from kvconnect.transport.options import BACKENDS, check_transport_options

__all__ = ["BACKENDS", "OPS", "TransferState", "Transport", "check_transport_options", "make_transport"]


def make_transport(backend: str, options: Mapping[str, Any]) -> Transport:
    """A new transport of `backend` with these options (checked first)."""
    parsed = msgspec.structs.asdict(check_transport_options(backend, options))
    # Imported here: a backend's module loads its library, which only the chosen backend needs.
    if backend == "nixl":
        from kvconnect.transport.nixl import NixlTransport

        return NixlTransport(**parsed)
    from kvconnect.transport.mooncake import MooncakeTransport

    return MooncakeTransport(**parsed)


def __getattr__(name: str) -> object:
    """Names that moved out of this package fail with a message naming their replacement."""
    if name in ("check_post", "check_peer_regions"):
        raise ImportError(f"kvconnect.transport.{name} was replaced by kvconnect.descriptors "
                          "(select, Pairing)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
