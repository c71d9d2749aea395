"""Mooncake's errors, mapped once onto kvconnect's typed transfer errors.

The Transfer Engine's Python binding raises RuntimeError or ValueError, or returns a code: 0 for
success, -1 for most failures, a few codes (its error.h) that say more. A failed batch returns -1
whatever the cause; how long it ran tells a refused or reset connection from Mooncake's own deadline.
"""

from __future__ import annotations

import contextlib
import os

from kvconnect.errors import LocalInvalid, PeerUnreachable, RemoteRejected, TransferError, TransferTimeout
from kvconnect.transport.base import library_errors, python_error_class

# Transfer Engine return codes (its error.h) that say more than "failed"; the rest map by call.
_RC_ERRORS: dict[int, type[TransferError]] = {-100: PeerUnreachable, -101: PeerUnreachable,  # DNS, socket
                                              -102: RemoteRejected, -103: RemoteRejected,  # bad or refused handshake
                                              -3: RemoteRejected}  # address not registered


def error_class(exc: BaseException) -> type[TransferError]:
    """The most specific kvconnect error for something the engine raised (it raises only Python's classes)."""
    return python_error_class(exc)


def mooncake_errors(what: str) -> contextlib.AbstractContextManager[None]:
    """Run Mooncake calls: whatever the engine raises becomes the matching TransferError naming `what`."""
    return library_errors("Mooncake", what, error_class)


def check_rc(rc: int, what: str, default: type[TransferError] = LocalInvalid) -> None:
    """A non-zero return code as the matching TransferError (`default`: what a bare failure means for this call)."""
    if rc != 0:
        raise _RC_ERRORS.get(rc, default)(f"Mooncake {what} (returned {rc})")


# Mooncake's deadlines for a batch, each 30 s unless set, read when an engine starts: the batch as a
# whole (MC_TRANSFER_TIMEOUT), and over TCP a connection with no bytes moving or no status frame from
# the peer. The first to pass fails the batch, so the earliest is the one that counts.
BATCH_DEADLINES = ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")


def _seconds(name: str) -> float:
    try:
        return float(os.environ.get(name, "30"))
    except ValueError:
        return 30.0


def batch_deadline_s() -> float:
    """The earliest of Mooncake's own deadlines for a batch: a batch failing this late timed out."""
    return min(_seconds(name) for name in BATCH_DEADLINES)


def failed_batch_kind(rc: int, took_s: float) -> str:
    """The TransferError kind of a batch that returned `rc` after `took_s` seconds."""
    if rc in _RC_ERRORS:
        return _RC_ERRORS[rc].kind
    return (TransferTimeout if took_s >= batch_deadline_s() else PeerUnreachable).kind
