"""The typed errors every kvconnect layer raises."""

from __future__ import annotations


class KVConnectError(Exception):
    """Base class of every error kvconnect raises on purpose."""


class LayoutError(KVConnectError, ValueError):
    """A KV-cache tensor or page does not have the layout kvconnect can move."""


class BlockRangeError(KVConnectError, IndexError):
    """A block id is not an integer inside the region it addresses."""


class HandshakeError(KVConnectError):
    """Metadata exchange with a peer failed: timeout, refusal, incompatibility, bad auth or garbled reply."""


class TransferError(KVConnectError):
    """A transfer could not be posted or did not complete."""
