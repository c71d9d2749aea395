"""kvconnect: the connector layer that moves LLM KV-cache blocks between serving workers."""

from kvconnect.errors import (
    BlockRangeError,
    HandshakeError,
    KVConnectError,
    LayoutError,
    TransferError,
)

__version__ = "0.1.0"

__all__ = [
    "BlockRangeError",
    "HandshakeError",
    "KVConnectError",
    "LayoutError",
    "TransferError",
    "__version__",
]
