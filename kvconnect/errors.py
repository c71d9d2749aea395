"""The typed errors every kvconnect layer raises.

Transfer failures come in a few kinds that callers act on differently (retry elsewhere, handshake
again, wait longer, give up on the request, fix the caller); each backend maps its library's errors
onto them once, in its own module, and logs, metrics and reports name the kind.
"""

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

    kind = "transfer"


class PeerUnreachable(TransferError):
    """The peer could not be reached: connection refused, reset or no route."""

    kind = "unreachable"


class PeerRestarted(TransferError):
    """The peer is a new process (another incarnation, or its agent metadata changed)."""

    kind = "restarted"


class TransferTimeout(TransferError):
    """The backend gave up waiting for the peer or for its own progress."""

    kind = "timeout"


class RemoteRejected(TransferError):
    """The peer or its backend refused the request (unknown memory, refused metadata, bad descriptors)."""

    kind = "rejected"


class LocalInvalid(TransferError):
    """This side asked for something it cannot do: a closed transport, a handle or option that is wrong."""

    kind = "invalid"


TRANSFER_ERRORS: tuple[type[TransferError], ...] = (
    TransferError, PeerUnreachable, PeerRestarted, TransferTimeout, RemoteRejected, LocalInvalid)
