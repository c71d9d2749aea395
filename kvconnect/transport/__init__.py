"""Transports move registered KV blocks between workers: `Transport` is the interface, one module per backend.

Backends import their library only when their module is imported (`kvconnect.transport.nixl`).
"""

from kvconnect.transport.base import OPS, TransferState, Transport, check_peer_regions, check_post

__all__ = ["OPS", "TransferState", "Transport", "check_peer_regions", "check_post"]
