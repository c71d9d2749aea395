"""Transports move registered KV blocks between workers: `Transport` is the interface, one module per backend.

Backends import their library only when their module is imported (`kvconnect.transport.nixl`);
`options` validates each backend's options without importing it and builds transports by name.
"""

from kvconnect.transport.base import OPS, TransferState, Transport, check_peer_regions, check_post
from kvconnect.transport.options import BACKENDS, check_transport_options, make_transport

__all__ = ["BACKENDS", "OPS", "TransferState", "Transport", "check_peer_regions", "check_post",
           "check_transport_options", "make_transport"]
