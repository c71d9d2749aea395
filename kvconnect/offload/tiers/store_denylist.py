"""Store objects that failed their checks: removed from the store, and denied here until that succeeds.

A corrupt object stays listed by the master, so every instance's lookup would count it as a hit
again; removing it stops that. Until a removal succeeds the name stays on a bounded deny list: this
tier's lookups answer it absent and its gets do not read it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from kvconnect.offload.tiers.calls import InFlight
from kvconnect.offload.tiers.store_staging import NOT_FOUND, TOO_LARGE

log = logging.getLogger("kvconnect.offload.store")

FORGET_WAIT_S = 1.0
MAX_DENIED = 4096


class DenyList:
    """Names of corrupt objects not yet removed from the store (at most MAX_DENIED, oldest dropped)."""

    def __init__(self, calls: InFlight, connected: Callable[[], Any]):
        self._names: OrderedDict[str, None] = OrderedDict()
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._calls = calls
        self._connected = connected  # the tier's client, or None while the store has not been reached

    def denied(self, names: Sequence[str]) -> np.ndarray:
        """True per name still denied."""
        with self._lock:
            if not self._names:
                return np.zeros(len(names), dtype=bool)
            return np.array([n in self._names for n in names], dtype=bool)

    def warn(self, names: Sequence[str], sizes: np.ndarray, full: int) -> None:
        """Log, once per object, why it failed its checks (`sizes`: what the get returned for it)."""
        for name, size in zip(names, sizes.tolist()):
            if name not in self._warned:
                self._warned.add(name)
                what = ("corrupt (checksum)" if size == full else f"larger than {full} bytes" if size == TOO_LARGE
                        else f"{size} bytes, not {full}")
                log.warning("store tier: object %s is %s; read as a miss and removed from the store", name, what)

    def forget(self, names: list[str]) -> None:
        """Deny `names` here and remove them from the store, waiting up to FORGET_WAIT_S.

        The removal is forced (Mooncake otherwise refuses an object leased to a reader for a few
        seconds after a get): every reader verifies anyway.
        """
        with self._lock:
            for name in names:
                self._names[name] = None
                self._names.move_to_end(name)
            while len(self._names) > MAX_DENIED:
                self._names.popitem(last=False)
        client = self._connected()
        if client is None:
            return

        def remove() -> None:
            for name in names:
                code = client.remove(name, True)
                if code in (0, NOT_FOUND):
                    with self._lock:
                        self._names.pop(name, None)
                else:
                    log.warning("store tier: removing corrupt object %s failed (%d); it stays denied here", name, code)

        self._calls.start(remove, "kvconnect-store-forget").join(FORGET_WAIT_S)
