"""Fault injection for the SGLang e2e, read from the decode server's environment.

`KVCONNECT_SGLANG_FAULT_LOAD_DELAY_S` makes the decode wait that long between receiving a request's
params and reading it (a prefill can then die in between). `KVCONNECT_SGLANG_FAULT_READ_HOLD_S`
makes every READ the decode posts read PENDING for that long, cancelled or not: a READ already inside
the transport that cannot be recalled, so an abort finds bytes that may still land.
"""

from __future__ import annotations

import logging
import os

from kvconnect.config import ConnectorConfig
from kvconnect.faults import FaultyTransport
from kvconnect.transport import Transport, make_transport

log = logging.getLogger(__name__)


def load_delay_s() -> float:
    """Seconds the decode waits before reading a request (0: none)."""
    return float(os.environ.get("KVCONNECT_SGLANG_FAULT_LOAD_DELAY_S", "0"))


def read_hold_s() -> float:
    """Seconds every decode READ stays PENDING, cancel or not (0: none)."""
    return float(os.environ.get("KVCONNECT_SGLANG_FAULT_READ_HOLD_S", "0"))


class UnrecallableReads(FaultyTransport):
    """`FaultyTransport` holding transfers PENDING for `delay_s` even once cancelled, and logging each post."""

    def post(self, *args, **kwargs) -> object:
        """Post through the real transport, and say so (a test waits for its READ to be in flight)."""
        handle = super().post(*args, **kwargs)
        log.warning("kvconnect sglang decode: fault injection: READ %d posted, in flight for %g s even if cancelled",
                    self.posted, self.delay_s)
        return handle


def decode_transport(config: ConnectorConfig) -> Transport | None:
    """The transport a decode's connector uses when READs are held (None: the connector's own)."""
    hold = read_hold_s()
    if hold <= 0:
        return None
    return UnrecallableReads(make_transport(config.backend, dict(config.transport_options)), delay_s=hold,
                             delay_outlives_cancel=True)
