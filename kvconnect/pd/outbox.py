"""Done and abort notices from a consumer to one producer, sent again until delivered or given up.

A notice that does not get through is sent again until its give-up time: a producer busy for a moment
would otherwise hold the blocks until their lease ran out. While the producer does not answer, new
notices wait with the others instead of each paying the connect timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

from kvconnect import metrics, wire
from kvconnect.errors import KVConnectError
from kvconnect.pd.failure import Stage
from kvconnect.sidechannel import Target, call_many

log = logging.getLogger("kvconnect.pd.outbox")

# How long new notices wait after one was not delivered, before the producer is tried again.
BACKOFF_S = 2.0


@dataclass(frozen=True)
class NoticeSettings:
    """Who sends the notices, and how long a send and its retries may take."""

    engine_id: str
    rank: int
    secret: bytes | str | None
    timeout_s: float
    retry_s: float


class Outbox:
    """The notices owed to one producer endpoint; `send()` delivers what it can within `timeout_s`."""

    def __init__(self, host: str, port: int, label: str, settings: NoticeSettings, clock: Callable[[], float]):
        self.host, self.port, self.label = host, port, label
        self.settings = settings
        self.clock = clock
        self._done: list[tuple[str, int]] = []  # (request id, readers)
        self._aborts: list[tuple[str, str, int]] = []  # (request id, reason, readers)
        self._unsent: list[tuple[float, Target]] = []  # notices to send again, with their give-up time
        self._down_until = 0.0

    @property
    def retrying(self) -> bool:
        """Notices are waiting to be sent again (the worker must not retire meanwhile)."""
        return bool(self._unsent)

    def done(self, request_id: str, readers: int) -> None:
        """Owe the producer a done notice: this consumer rank finished with the lease."""
        self._done.append((request_id, readers))

    def abort(self, request_id: str, reason: str, readers: int) -> None:
        """Owe the producer an abort notice: this consumer rank gave up on the lease."""
        self._aborts.append((request_id, reason[:1000], readers))

    def reachable(self) -> None:
        """The producer answered (a new handshake): stop backing off."""
        self._down_until = 0.0

    def send(self) -> None:
        """Send every notice owed and every one due again; keep those that failed until their give-up time."""
        s = self.settings
        now = self.clock()
        if not (self._done or self._aborts or self._unsent) or now < self._down_until:
            return
        targets = self._targets()
        retries = len(self._unsent)
        pending = self._unsent + [(now + s.retry_s, t) for t in targets]
        self._unsent = []
        results = call_many([t for _, t in pending], timeout=s.timeout_s, secret=s.secret)
        for i, ((give_up, target), result) in enumerate(zip(pending, results)):
            if isinstance(result, KVConnectError):
                self._undelivered(give_up, target, result, first=i >= retries)

    def _targets(self) -> list[Target]:
        s = self.settings
        done, aborts = self._done, self._aborts
        self._done, self._aborts = [], []
        targets = [Target(self.host, self.port, wire.Done(
            engine_id=s.engine_id, rank=s.rank, request_ids=tuple(rid for rid, _ in chunk), readers=chunk[0][1]))
            for same in _by_last(done) for chunk in chunks(same, wire.MAX_IDS_PER_MESSAGE)]
        targets += [Target(self.host, self.port, wire.Abort(
            engine_id=s.engine_id, rank=s.rank, request_ids=tuple(rid for rid, _, _ in chunk), reason=chunk[0][1],
            readers=chunk[0][2])) for same in _by_last(aborts) for chunk in chunks(same, wire.MAX_IDS_PER_MESSAGE)]
        return targets

    def _undelivered(self, give_up: float, target: Target, error: KVConnectError, first: bool) -> None:
        ids = ",".join(target.message.request_ids)
        self._down_until = self.clock() + BACKOFF_S
        if self.clock() < give_up:
            if first:
                log.info("kvconnect consumer: notice for %s to %s not delivered (%s); retrying for %.0f s",
                         ids, self.label, error, self.settings.retry_s)
            self._unsent.append((give_up, target))
            return
        metrics.failures.labels(Stage.NOTIFY.value).inc()
        log.warning("kvconnect notice not delivered: request=%s peer=%s stage=%s reason=%s", ids, self.label,
                    Stage.NOTIFY.value, error)


def _by_last(items: list[tuple]) -> list[list[tuple]]:
    """Items grouped by their last field (the readers count a notice carries for all its ids)."""
    groups: dict[object, list[tuple]] = {}
    for item in items:
        groups.setdefault(item[-1], []).append(item)
    return list(groups.values())


def chunks(items: list, size: int) -> Iterator[list]:
    """`items` in consecutive lists of at most `size`."""
    for i in range(0, len(items), size):
        yield items[i:i + size]
