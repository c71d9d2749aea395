"""Why a load or a push failed, as types: the stage it reached, and the kind of error that ended it.

Logs, metrics and `Finished` all read these; nothing parses a reason string.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvconnect.errors import KVConnectError, TransferError


class Stage(str, enum.Enum):
    """Where in a request's life it failed (a `str` enum: its value is the metric label)."""

    PARAMS = "params"  # the transfer params or block ids were refused before anything was sent
    HANDSHAKE = "handshake"  # the peer's metadata could not be fetched or did not match ours
    LEASE = "lease"  # the peer refused or lost the lease (restarted, expired, never held)
    OFFER = "offer"  # push: the prefill did not take the decode's offer
    POST = "post"  # the transport refused to post the transfer
    TRANSFER = "transfer"  # the transfer failed or ran out of time
    NOTIFY = "notify"  # a done or abort notice never reached the peer
    ABORT = "abort"  # the engine gave up on the request
    SHUTDOWN = "shutdown"  # the connector closed with the request in flight
    INTERNAL = "internal"  # a kvconnect bug: reported rather than left hanging

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LoadFailure:
    """Why a load failed: the stage it reached, the kind of error (`TransferError.kind`, or "" when the
    cause was not a transfer error) and a reason for people."""

    stage: Stage
    reason: str
    kind: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", Stage(self.stage))

    @classmethod
    def of(cls, stage: Stage, exc: KVConnectError) -> LoadFailure:
        """A failure caused by `exc`, its kind taken from the exception's type."""
        return cls(stage, str(exc), exc.kind if isinstance(exc, TransferError) else "")

    def __str__(self) -> str:
        return f"{self.stage.value}: {self.reason}"
