"""NIXL's exceptions, mapped once onto kvconnect's typed transfer errors.

NIXL raises one class per status code (`nixlRemoteDisconnectError` for NIXL_ERR_REMOTE_DISCONNECT,
and so on), from whichever build is installed (`nixl_cu12`, `nixl_cu13`): they are matched by name.
Every NIXL call of the transport runs inside `nixl_errors(what)`; clean-up calls go through
`quietly`, which logs instead of raising.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

from kvconnect.errors import LocalInvalid, PeerUnreachable, RemoteRejected, TransferError
from kvconnect.transport.base import library_errors, python_error_class

log = logging.getLogger("kvconnect.transport.nixl")

# NIXL's class name -> the kind of failure it reports.
ERRORS: dict[str, type[TransferError]] = {
    "nixlRemoteDisconnectError": PeerUnreachable,  # the peer's process or connection went away
    "nixlNotFoundError": RemoteRejected,  # an agent, registration or memory the request names is unknown
    "nixlMismatchError": RemoteRejected,  # metadata that does not match what is loaded under that agent
    "nixlInvalidParamError": LocalInvalid,
    "nixlNotAllowedError": LocalInvalid,
    "nixlNotPostedError": LocalInvalid,
    "nixlRepostActiveError": LocalInvalid,
    "nixlNotSupportedError": LocalInvalid,
    "nixlNoTelemetryError": LocalInvalid,
    "nixlCancelledError": TransferError,
    "nixlBackendError": TransferError,  # the backend (UCX) failed without saying why in a way NIXL passes on
    "nixlUnknownError": TransferError,
}


def error_class(exc: BaseException) -> type[TransferError]:
    """The most specific kvconnect error for something NIXL (or its Python layer) raised."""
    return ERRORS.get(type(exc).__name__) or python_error_class(exc)


def nixl_errors(what: str) -> contextlib.AbstractContextManager[None]:
    """Run NIXL calls: whatever the library raises becomes the matching TransferError naming `what`."""
    return library_errors("NIXL", what, error_class)


def quietly(what: str, fn: Callable[..., object], *args: object) -> bool:
    """Run a NIXL clean-up call; log and return False if it fails (clean-up goes on regardless)."""
    try:
        with nixl_errors(what):
            fn(*args)
        return True
    except TransferError as exc:
        log.warning("kvconnect nixl: %s", exc)
        return False
