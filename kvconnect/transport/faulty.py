"""A transport that wraps a real one and injects failures; for fault tests only.

    t = FaultyTransport(NixlTransport(), fail_poll_after=3)   # every transfer FAILs on its 4th poll
    t.fail_posts = 1                                            # the next post raises TransferError

Knobs (plain attributes, so a test can change them between calls): `fail_posts` makes the next N
posts raise TransferError (-1: every post); `fail_poll_after` makes polls past the Nth of a handle read
FAILED; `drop_notifications` makes outgoing notifications vanish (standalone ones and those riding on
posts; counted in `dropped`); `delay_s` makes transfers read PENDING for that long after posting.
"""

from __future__ import annotations

import time
from typing import Callable

from kvconnect.errors import TransferError
from kvconnect.regions import BlockIds, RegionSet
from kvconnect.transport.base import RegionIndices, TransferState, Transport


class _Handle:
    __slots__ = ("inner", "posted_at", "polls")

    def __init__(self, inner: object, posted_at: float):
        self.inner = inner
        self.posted_at = posted_at
        self.polls = 0


class FaultyTransport(Transport):
    """Delegates to `inner`, failing posts, failing polls, dropping notifications or delaying completion."""

    def __init__(self, inner: Transport, *, fail_posts: int = 0, fail_poll_after: int | None = None,
                 drop_notifications: bool = False, delay_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        """Wrap `inner`; every knob starts off unless given here."""
        self.inner = inner
        self.name = inner.name
        self.fail_posts = fail_posts
        self.fail_poll_after = fail_poll_after
        self.drop_notifications = drop_notifications
        self.delay_s = delay_s
        self.dropped = 0
        self._clock = clock

    def register(self, regions: RegionSet) -> None:
        """Delegated."""
        self.inner.register(regions)

    def local_metadata(self) -> bytes:
        """Delegated."""
        return self.inner.local_metadata()

    def add_peer(self, peer_id: str, metadata: bytes, regions: RegionSet) -> None:
        """Delegated."""
        self.inner.add_peer(peer_id, metadata, regions)

    def remove_peer(self, peer_id: str) -> None:
        """Delegated."""
        self.inner.remove_peer(peer_id)

    def post(self, op: str, peer_id: str, local_ids: BlockIds, remote_ids: BlockIds, *,
             regions: RegionIndices = None, notif: bytes = b"") -> _Handle:
        """Raise while `fail_posts` says so, else post through `inner`."""
        if self.fail_posts:
            if self.fail_posts > 0:
                self.fail_posts -= 1
            raise TransferError(f"injected post failure ({op} from {peer_id})")
        if notif and self.drop_notifications:
            self.dropped += 1
            notif = b""
        inner = self.inner.post(op, peer_id, local_ids, remote_ids, regions=regions, notif=notif)
        return _Handle(inner, self._clock())

    def poll(self, handle: object) -> TransferState:
        """FAILED past `fail_poll_after` polls, PENDING during `delay_s`, else what `inner` says."""
        h = _unwrap(handle)
        h.polls += 1
        if self.fail_poll_after is not None and h.polls > self.fail_poll_after:
            return TransferState.FAILED
        if self._clock() - h.posted_at < self.delay_s:
            return TransferState.PENDING
        return self.inner.poll(h.inner)

    def release(self, handle: object) -> None:
        """Delegated."""
        self.inner.release(_unwrap(handle).inner)

    def notify(self, peer_id: str, message: bytes) -> None:
        """Dropped (and counted) when `drop_notifications`, else delegated."""
        if self.drop_notifications:
            self.dropped += 1
            return
        self.inner.notify(peer_id, message)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Delegated."""
        return self.inner.notifications()

    def close(self) -> None:
        """Delegated."""
        self.inner.close()


def _unwrap(handle: object) -> _Handle:
    if not isinstance(handle, _Handle):
        raise TransferError(f"not a FaultyTransport handle: {handle!r}")
    return handle
