"""The transport interface: how registered KV blocks move between this worker and its peers.

A transport registers one `RegionSet` and hands out metadata bytes; peers are added from their
metadata plus their `RegionSet` (both arrive through kvconnect's side channel), or plus a
`kvconnect.descriptors.Pairing` already made against the registered regions: how the two sides'
regions pair is checked once, when the peer is added. `post()` pairs `local_ids[k]` with
`remote_ids[k]` in every selected region (`regions`: region indices, default all): READ pulls peer
blocks into local ones, WRITE pushes local blocks to the peer. It takes either an op and both id
lists, checked there (BlockRangeError), or a `Selection` already checked by `kvconnect.descriptors`,
which it only matches to the peer by identity. `poll()` the handle until DONE or FAILED, then
`release()` it. A failure to post is a `TransferError` of the kind the backend's error mapping says;
a failure afterwards a FAILED poll.

DONE and FAILED are final: once `poll` returns either, no byte of that transfer lands any more. A
caller that gives up on a transfer `cancel()`s it and keeps polling until it is final before it
reuses the blocks: some backends cannot recall bytes already on their way.

    transport.register(regions)
    transport.add_peer("prefill-0", peer_metadata, peer_regions)
    handle = transport.post("READ", "prefill-0", local_ids, remote_ids)
    # or, checked once and posted as it is: transport.post(selection, "prefill-0")
    state = transport.wait(handle, timeout_s=10.0)
    transport.release(handle)
    transport.close()
"""

from __future__ import annotations

import abc
import contextlib
import enum
import threading
import time
from typing import Callable, Iterator

from kvconnect.descriptors import OPS, Pairing, RegionIndices, Selection
from kvconnect.errors import KVConnectError, LocalInvalid, PeerUnreachable, TransferError, TransferTimeout
from kvconnect.regions import BlockIds, RegionSet
from kvconnect.shards import PageSlices

__all__ = ["OPS", "RegionIndices", "TransferState", "Transport"]


class TransferState(enum.Enum):
    """Where a posted transfer stands; DONE and FAILED are final."""

    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


class Transport(abc.ABC):
    """Moves blocks of registered regions to and from peers; one instance per worker process."""

    name: str = ""  # backend name peers must share, carried in kvconnect's metadata
    label: str = ""  # how messages name the backend

    @abc.abstractmethod
    def register(self, regions: RegionSet) -> None:
        """Register the local regions with the backend; once per transport."""

    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """What a peer passes to `add_peer` to reach this transport (call after `register`)."""

    @abc.abstractmethod
    def add_peer(self, peer_id: str, metadata: bytes, regions: RegionSet | Pairing,
                 slices: PageSlices | None = None) -> None:
        """Make a peer addressable by a new `peer_id`; an id already in use is a TransferError, and a
        failed add leaves every other peer as it was. `slices` pairs byte ranges of each region's
        blocks (a peer of another TP size); without it whole blocks pair and their sizes must match.
        A `Pairing` made against the registered regions carries both and is taken as it is."""

    @abc.abstractmethod
    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer, cancelling its transfers still in flight; unknown ids are ignored."""

    def post(self, op: str | Selection, peer_id: str, local_ids: BlockIds | None = None,
             remote_ids: BlockIds | None = None, *, regions: RegionIndices = None) -> object:
        """Start moving peer blocks `remote_ids[k]` to/from local `local_ids[k]`; returns a handle. `op` may
        instead be a `Selection` made for the registered regions and this peer's: posted as it is."""
        with self._lock:
            self._check_registered("posting")
            peer = self._peers.get(peer_id)
            if peer is None:
                raise LocalInvalid(f"unknown peer {peer_id!r}: add_peer first")
            if not isinstance(op, Selection):
                return self._post(peer_id, peer, peer.pairing.select(op, local_ids, remote_ids, regions))
            if local_ids is not None or remote_ids is not None or regions is not None:
                raise LocalInvalid("a Selection carries its own block ids and regions")
            peer.pairing.admit(op)  # its pairing was made against `local`: one identity check covers both sides
            return self._post(peer_id, peer, op)

    def _post(self, peer_id: str, peer: object, selection: Selection) -> object:
        """Post a checked selection to a known peer (the lock held); returns a handle. Backends that keep
        `post` implement this; a wrapper that overrides `post` itself need not."""
        raise NotImplementedError(f"{type(self).__name__} posts through its own post()")

    def failure_kind(self, handle: object) -> str:
        """The `TransferError.kind` a FAILED transfer failed with, as far as the backend said ("transfer")."""
        return getattr(handle, "kind", "") or "transfer"

    @abc.abstractmethod
    def poll(self, handle: object) -> TransferState:
        """The state of a posted transfer; never raises for a backend failure (that is FAILED)."""

    @abc.abstractmethod
    def cancel(self, handle: object) -> None:
        """Stop a transfer: it submits nothing more and reads FAILED once nothing can land any more."""

    @abc.abstractmethod
    def release(self, handle: object) -> None:
        """Free a handle (cancelling it first if it is still pending)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release handles, drop peers, deregister memory, then the backend; idempotent."""

    # ---- shared by the real backends: a lock, an open flag, registered regions, peers by id ----

    _lock: threading.RLock
    _closed: bool = False
    _regions: RegionSet | None = None
    _peers: dict

    @property
    def closed(self) -> bool:
        """Whether `close()` ran."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise LocalInvalid(f"the {self.label} transport is closed")

    def _check_registering(self) -> None:
        self._check_open()
        if self._regions is not None:
            raise LocalInvalid("this transport already registered its regions")

    def _check_registered(self, what: str) -> RegionSet:
        self._check_open()
        if self._regions is None:
            raise LocalInvalid(f"register regions before {what}")
        return self._regions

    def _new_pairing(self, peer_id: str, regions: RegionSet | Pairing, slices: PageSlices | None) -> Pairing:
        """How a new peer's regions pair with ours: checked here, or (a `Pairing`) matched by identity."""
        local = self._check_registered("adding peers")
        if peer_id in self._peers:
            raise LocalInvalid(f"peer id {peer_id!r} is already in use")
        if not isinstance(regions, Pairing):
            return Pairing(local, regions, slices)
        if slices is not None:
            raise LocalInvalid("a Pairing carries its own slices")
        if regions.local is not local:
            raise LocalInvalid("the pairing was made for other regions than this transport registered")
        return regions

    def wait(self, handle: object, timeout_s: float, interval_s: float = 0.0005) -> TransferState:
        """Poll until DONE or FAILED, or until `timeout_s` passes (then PENDING: the caller decides)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.poll(handle)
            if state is not TransferState.PENDING or time.monotonic() >= deadline:
                return state
            time.sleep(interval_s)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def python_error_class(exc: BaseException) -> type[TransferError]:
    """The kvconnect error for a Python exception a backend binding raised that says nothing more specific."""
    if isinstance(exc, TimeoutError):
        return TransferTimeout
    if isinstance(exc, ConnectionError):
        return PeerUnreachable
    if isinstance(exc, (ValueError, TypeError)):  # a binding refusing an argument
        return LocalInvalid
    return TransferError  # RuntimeError and the rest: the library failed without saying how


@contextlib.contextmanager
def library_errors(backend: str, what: str, classify: Callable[[BaseException], type[TransferError]]) -> Iterator[None]:
    """Run a backend library's calls: what it raises becomes the `classify`d TransferError naming `what`."""
    try:
        yield
    except KVConnectError:
        raise
    except Exception as exc:  # libraries raise their own classes, RuntimeError and ValueError alike
        raise classify(exc)(f"{backend} {what}: {type(exc).__name__}: {exc}") from exc


_MOVED = {"check_post": "kvconnect.descriptors.select", "paired_descriptors": "kvconnect.descriptors.Pairing.rows",
          "check_slices": "kvconnect.descriptors.Pairing", "check_peer_regions": "kvconnect.descriptors.Pairing",
          "mapped_errors": "each backend's own error mapping (kvconnect.transport.nixl_errors, .mooncake_errors)"}


def __getattr__(name: str) -> object:
    """Names that moved out of this module fail with a message naming their replacement."""
    if name in _MOVED:
        raise ImportError(f"kvconnect.transport.base.{name} was replaced by {_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
