"""Fault injection for kvconnect's own tests and for operators testing their deployments.

Three pieces, each small enough to read in one sitting:

- `FaultyTransport(inner, ...)` wraps a real transport and fails posts, fails polls, or holds
  transfers PENDING for a while, so a load's failure paths run against the real library.
- `HostileListener(metadata, ...)` is a side-channel listener that answers the handshake with
  whatever metadata it is given (a healthy producer's identity with absurd regions, say) and grants
  every claim, so a consumer can be pointed at a peer that lies.
- `stalled(pid)` stops a process (SIGSTOP) for the duration of a `with` block and resumes it
  (SIGCONT) afterwards: a producer that hangs without dying.

    with stalled(prefill_pid):
        ...  # loads from that producer must fail within their deadline, others must not notice
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Callable, Iterator

from kvconnect import wire
from kvconnect.descriptors import Pairing, Selection
from kvconnect.errors import TransferError
from kvconnect.regions import BlockIds, RegionSet
from kvconnect.shards import PageSlices
from kvconnect.sidechannel import SideChannelServer, metadata_handler
from kvconnect.transport.base import RegionIndices, TransferState, Transport


class _Handle:
    __slots__ = ("inner", "posted_at", "polls")

    def __init__(self, inner: object, posted_at: float):
        self.inner = inner
        self.posted_at = posted_at
        self.polls = 0


class FaultyTransport(Transport):
    """Delegates to `inner`, failing posts, failing polls or delaying completion.

    Knobs (plain attributes, so a test can change them between calls): `fail_posts` makes the next N
    posts raise TransferError (-1: every post); `fail_poll_after` makes polls past the Nth of a handle
    read FAILED; `delay_s` makes transfers read PENDING for that long after posting (and, with
    `delay_outlives_cancel`, even once cancelled: a transfer the library cannot recall).
    """

    def __init__(self, inner: Transport, *, fail_posts: int = 0, fail_poll_after: int | None = None,
                 delay_s: float = 0.0, delay_outlives_cancel: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.name, self.label = inner.name, inner.label
        self.fail_posts = fail_posts
        self.fail_poll_after = fail_poll_after
        self.delay_s = delay_s
        self.delay_outlives_cancel = delay_outlives_cancel
        self.posted = 0
        self.last_posted: object | None = None  # the inner transport's handle of the latest post
        self._clock = clock

    def register(self, regions: RegionSet) -> None:
        """Delegated."""
        self.inner.register(regions)

    def local_metadata(self) -> bytes:
        """Delegated."""
        return self.inner.local_metadata()

    def add_peer(self, peer_id: str, metadata: bytes, regions: RegionSet | Pairing,
                 slices: PageSlices | None = None) -> None:
        """Delegated."""
        self.inner.add_peer(peer_id, metadata, regions, slices)

    def remove_peer(self, peer_id: str) -> None:
        """Delegated."""
        self.inner.remove_peer(peer_id)

    def post(self, op: str | Selection, peer_id: str, local_ids: BlockIds | None = None,
             remote_ids: BlockIds | None = None, *, regions: RegionIndices = None) -> _Handle:
        """Raise while `fail_posts` says so, else post through `inner`."""
        if self.fail_posts:
            if self.fail_posts > 0:
                self.fail_posts -= 1
            raise TransferError(f"injected post failure ({getattr(op, 'op', op)} with {peer_id})")
        handle = _Handle(self.inner.post(op, peer_id, local_ids, remote_ids, regions=regions), self._clock())
        self.posted += 1
        self.last_posted = handle.inner
        return handle

    def failure_kind(self, handle: object) -> str:
        """Delegated."""
        return self.inner.failure_kind(_unwrap(handle).inner)

    def poll(self, handle: object) -> TransferState:
        """FAILED past `fail_poll_after` polls, PENDING during `delay_s`, else what `inner` says."""
        h = _unwrap(handle)
        h.polls += 1
        if self.fail_poll_after is not None and h.polls > self.fail_poll_after:
            return TransferState.FAILED
        if self._clock() - h.posted_at < self.delay_s:
            return TransferState.PENDING
        return self.inner.poll(h.inner)

    def cancel(self, handle: object) -> None:
        """Delegated; the injected delay ends with it unless `delay_outlives_cancel`."""
        h = _unwrap(handle)
        if not self.delay_outlives_cancel:
            h.posted_at = -float("inf")
        self.inner.cancel(h.inner)

    def release(self, handle: object) -> None:
        """Delegated."""
        self.inner.release(_unwrap(handle).inner)

    def close(self) -> None:
        """Delegated."""
        self.inner.close()


def _unwrap(handle: object) -> _Handle:
    if not isinstance(handle, _Handle):
        raise TransferError(f"not a FaultyTransport handle: {handle!r}")
    return handle


class HostileListener(SideChannelServer):
    """A side-channel listener that serves `metadata` (true or not) and grants every claim.

    Build the lie from a real producer's metadata with `msgspec.structs.replace`, e.g. its identity
    and compatibility fingerprint with regions of 2**45 blocks. `requests` counts what it was sent.
    """

    def __init__(self, metadata: wire.EngineMetadata, *, host: str = "127.0.0.1", port: int = 0,
                 secret: bytes | str | None = None, claim_s: float = 600.0):
        self.metadata = metadata
        self.requests: list[wire.RequestBody] = []

        def control(msg: wire.ControlMessage) -> wire.ReplyBody:
            self.requests.append(msg)
            if isinstance(msg, wire.Claim):
                return wire.ClaimReply(granted_s={rid: claim_s for rid in msg.request_ids},
                                       incarnation=metadata.incarnation)
            return wire.Ack(live=msg.request_ids)

        def provide(rank: int) -> wire.EngineMetadata:
            self.requests.append(wire.HandshakeRequest(rank=rank))
            return metadata

        super().__init__(metadata_handler(provide, control), host=host, port=port, secret=secret)


@contextlib.contextmanager
def stalled(pid: int) -> Iterator[None]:
    """Stop process `pid` (SIGSTOP) inside the block and resume it (SIGCONT) on the way out, whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
