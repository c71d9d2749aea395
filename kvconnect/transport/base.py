"""The transport interface: how registered KV blocks move between this worker and its peers.

A transport registers one `RegionSet` and hands out metadata bytes; peers are added from their
metadata plus their `RegionSet` (both arrive through kvconnect's side channel). `post()` pairs
`local_ids[k]` with `remote_ids[k]` in every selected region (`regions`: region indices, default all;
regions match by index and need equal block bytes): READ pulls peer blocks into local ones, WRITE
pushes local blocks to the peer. `poll()` the handle until DONE or FAILED, then `release()` it.
Every id is checked against both sides' regions before anything is posted (BlockRangeError); a
failure to post is TransferError, a failure afterwards a FAILED poll.

DONE and FAILED are final: once `poll` returns either, no byte of that transfer lands any more. A
caller that gives up on a transfer `cancel()`s it and keeps polling until it is final before it
reuses the blocks: some backends cannot recall bytes already on their way.

    transport.register(regions)
    transport.add_peer("prefill-0", peer_metadata, peer_regions)
    handle = transport.post("READ", "prefill-0", local_ids, remote_ids)
    state = transport.wait(handle, timeout_s=10.0)
    transport.release(handle)
    transport.close()
"""

from __future__ import annotations

import abc
import contextlib
import enum
import time
from typing import Iterator, Sequence

import numpy as np

from kvconnect.errors import BlockRangeError, KVConnectError, LayoutError, TransferError
from kvconnect.regions import BlockIds, RegionSet, pair_descriptors
from kvconnect.shards import PageSlices, slice_descriptors

OPS = ("READ", "WRITE")
RegionIndices = Sequence[int] | np.ndarray | None


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
    def add_peer(self, peer_id: str, metadata: bytes, regions: RegionSet, slices: PageSlices | None = None) -> None:
        """Make a peer addressable by a new `peer_id`; an id already in use is a TransferError, and a
        failed add leaves every other peer as it was. `slices` pairs byte ranges of each region's
        blocks (a peer of another TP size); without it whole blocks pair and their sizes must match."""

    @abc.abstractmethod
    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer, cancelling its transfers still in flight; unknown ids are ignored."""

    @abc.abstractmethod
    def post(self, op: str, peer_id: str, local_ids: BlockIds, remote_ids: BlockIds, *,
             regions: RegionIndices = None) -> object:
        """Start moving peer blocks `remote_ids[k]` to/from local `local_ids[k]`; returns a handle."""

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

    # ---- shared by the real backends: an open flag, registered regions, peers by id ----

    _closed: bool = False
    _regions: RegionSet | None = None
    _peers: dict

    @property
    def closed(self) -> bool:
        """Whether `close()` ran."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"the {self.label} transport is closed")

    def _check_registering(self) -> None:
        self._check_open()
        if self._regions is not None:
            raise TransferError("this transport already registered its regions")

    def _check_registered(self, what: str) -> RegionSet:
        self._check_open()
        if self._regions is None:
            raise TransferError(f"register regions before {what}")
        return self._regions

    def _check_new_peer(self, peer_id: str, regions: RegionSet, slices: PageSlices | None) -> None:
        local = self._check_registered("adding peers")
        if peer_id in self._peers:
            raise TransferError(f"peer id {peer_id!r} is already in use")
        if slices is None:
            check_peer_regions(local, regions)
        else:
            check_slices(local, regions, slices)

    def _checked_post(self, op: str, peer_id: str, local_ids: BlockIds, remote_ids: BlockIds,
                      regions: RegionIndices) -> tuple[object, np.ndarray, np.ndarray, np.ndarray]:
        """The peer, the selected regions and both id arrays of a post, after every check it needs."""
        local = self._check_registered("posting")
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(f"unknown peer {peer_id!r}: add_peer first")
        return (peer, *check_post(op, local, local_ids, peer.regions, remote_ids, regions))

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


@contextlib.contextmanager
def mapped_errors(backend: str, what: str) -> Iterator[None]:
    """Turn whatever a backend library raises inside the block into one TransferError naming the operation."""
    try:
        yield
    except KVConnectError:
        raise
    except Exception as exc:  # libraries raise their own classes, RuntimeError and ValueError alike
        raise TransferError(f"{backend} {what}: {type(exc).__name__}: {exc}") from exc


def check_post(op: str, local: RegionSet, local_ids: BlockIds, remote: RegionSet, remote_ids: BlockIds,
               regions: RegionIndices = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Selected region indices and both id arrays (int64), after every check a post needs."""
    if op not in OPS:
        raise TransferError(f"unknown transfer op {op!r} (expected READ or WRITE)")
    lids = local.validate(local_ids, regions)
    rids = remote.validate(remote_ids, regions)
    if lids.size != rids.size:
        raise BlockRangeError(f"{lids.size} local block ids but {rids.size} remote block ids")
    dst = lids if op == "READ" else rids
    if dst.size > 1:
        # Two sources landing in one block would leave it holding whichever finished last.
        ordered = np.sort(dst)
        twice = ordered[1:][ordered[1:] == ordered[:-1]]
        if twice.size:
            side = "local" if op == "READ" else "remote"
            raise BlockRangeError(f"{op} names {side} block {int(twice[0])} more than once as a destination")
    sel = np.arange(len(local)) if regions is None else np.asarray(regions, dtype=np.int64).reshape(-1)
    return sel, lids, rids


def paired_descriptors(local: RegionSet, lids: np.ndarray, remote: RegionSet, rids: np.ndarray, sel: np.ndarray,
                       slices: PageSlices | None) -> tuple[np.ndarray, np.ndarray]:
    """Matched local and peer descriptors of a post: whole blocks, or the peer's slices of them."""
    if slices is None:
        return pair_descriptors(local, lids, remote, rids, sel)
    return slice_descriptors(local, lids, remote, rids, slices, sel)


def check_slices(local: RegionSet, remote: RegionSet, slices: PageSlices) -> None:
    """Refuse slices that name a region either side lacks or a byte outside either side's block."""
    if len(local) != len(remote):
        raise LayoutError(f"local has {len(local)} regions, peer has {len(remote)}")
    for k, (lo, ro, ln) in slices.items():
        if not 0 <= k < len(local):
            raise LayoutError(f"slices name region {k}, outside 0..{len(local) - 1}")
        lo, ro, ln = (np.asarray(a, dtype=np.int64) for a in (lo, ro, ln))
        if not (lo.shape == ro.shape == ln.shape) or (ln.size and (min(lo.min(), ro.min()) < 0 or ln.min() < 1)):
            raise LayoutError(f"region {k}: malformed slices")
        if ln.size and ((lo + ln).max() > local[k].block_bytes or (ro + ln).max() > remote[k].block_bytes):
            raise LayoutError(f"region {k} ({local[k].label}): a slice runs past a block "
                              f"({local[k].block_bytes} bytes here, {remote[k].block_bytes} on the peer)")


def check_peer_regions(local: RegionSet, remote: RegionSet) -> None:
    """Refuse a peer whose regions cannot pair with ours (matched by index, equal block bytes)."""
    if len(local) != len(remote):
        raise LayoutError(f"local has {len(local)} regions, peer has {len(remote)}")
    for k, (a, b) in enumerate(zip(local.regions, remote.regions)):
        if a.block_bytes != b.block_bytes:
            raise LayoutError(f"region {k} ({a.label}): local blocks are {a.block_bytes} bytes, "
                              f"peer blocks are {b.block_bytes} bytes")
