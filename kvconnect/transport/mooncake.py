"""Mooncake transport: one Transfer Engine per worker, P2P handshake, TCP here and RDMA where the host has it.

The engine runs in P2P-handshake mode: no metadata server, each engine serves its own segment
description on an RPC port. What a peer needs is that `host:port` (plus the protocol, checked at
`add_peer`), a few bytes that travel inside kvconnect's handshake. Regions are registered once, as
`RegionSet.registration()` merges them. A post pairs local and remote block descriptors with
the peer's `kvconnect.descriptors.Pairing` (whole blocks, or for a peer of another TP size byte
slices; runs contiguous on both sides become one entry) and cuts them into batches of at most `max_batch_entries` entries.

Why the batches are cut: over TCP a peer connection queues `MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`
entries (1024 by default); up to `MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER` more (1024) wait to be
admitted for at most `MC_TCP_ADMISSION_TIMEOUT_MS` (1000 ms); past either bound the whole batch
returns -1. So the largest batch that works depends on the entry count *and* on the bytes: measured
on loopback, 2058 entries of 64 B and 2083 of 64 KiB work, but only 1655 of 1 MiB (the entries past
1024 must be admitted within a second). Batches of at most 1024 entries never wait for admission,
whatever their size; raise `max_batch_entries` only together with those variables.

Mooncake's Python API has no non-blocking status for a whole batch (`get_batch_transfer_status`
blocks until the batches end; `transfer_check_status` looks at the first entry only), so every
peer gets a worker thread that takes its posted transfers in order and runs their batches through
the blocking `batch_transfer_sync_read/write`, which release the GIL. `post()` only validates and
queues; `poll()` reads the state the worker wrote. A worker per peer, not per transport, because a
peer that hangs (stopped, not dead) holds a batch until Mooncake's deadline, and that must not stall
the other peers. One batch at a time per Mooncake session, whichever peer id posted it, keeps
within the queue bound above. A transfer that is cancelled (or released, or whose peer is removed)
submits no further batch; it reads FAILED at once if no batch of it is running, else when that batch
returns, since a batch handed to Mooncake cannot be recalled and may still write its blocks.

Mooncake returns -1 for any failure, which reads FAILED. A peer killed mid-batch fails it within
about 0.1 s over TCP (the connection resets); a later batch to it fails within a second (connection
refused). A hung peer fails a batch only at the earliest of Mooncake's own deadlines
(`MC_TRANSFER_TIMEOUT`, and over TCP `MC_TCP_PROGRESS_TIMEOUT_SEC` and `MC_TCP_STATUS_TIMEOUT_SEC`;
30 s each by default, read when an engine is created): callers keep a deadline of their own.
Those deadlines are wall time: a host that stalls this long (either end) fails the batch just the same,
sometimes without a line in Mooncake's log.

Mooncake's errors are mapped once, here: what the engine raises goes through `mooncake_errors(what)`, a
non-zero return code through `_check_rc`, each to the most specific typed TransferError; a failed
batch records its kind (a reset or refused connection, or Mooncake's deadline) on the transfer.

Mooncake logs a lot through glog at INFO. Unless `MC_LOG_LEVEL` is already set, the first transport
sets it to WARNING; it only takes effect if `mooncake.engine` was not imported before.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import re
import threading
import time
import weakref
from types import ModuleType
from typing import Annotated, Any, Callable

import msgspec
import numpy as np

from kvconnect.descriptors import Pairing, Selection
from kvconnect.errors import KVConnectError, LayoutError, LocalInvalid, RemoteRejected, TransferError
from kvconnect.regions import MemoryKind, RegionSet
from kvconnect.shards import PageSlices
from kvconnect.threads import spawn
from kvconnect.transport.base import TransferState, Transport
from kvconnect.transport.mooncake_errors import check_rc, error_class, failed_batch_kind, mooncake_errors
from kvconnect.transport.options import DEFAULT_MAX_BATCH_ENTRIES, MooncakeOptions, check_transport_options

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BATCH_ENTRIES", "MooncakeTransport", "import_engine"]  # the first: re-exported
_DEFAULTS = MooncakeOptions()
_MAX_METADATA_BYTES = 1024
_SESSION = re.compile(r"[A-Za-z0-9._-]+:[0-9]{1,5}")

_open: weakref.WeakSet[MooncakeTransport] = weakref.WeakSet()
# A transfer's state changes under this lock: the worker ending it and a caller cancelling it race.
_state_lock = threading.Lock()


@atexit.register
def _close_open_transports() -> None:
    for transport in list(_open):
        transport.close()


class _PeerInfo(msgspec.Struct, forbid_unknown_fields=True, frozen=True, tag="mooncake/1"):
    """A transport's metadata: the engine's P2P session name (`host:rpc_port`) and its protocol."""

    session: Annotated[str, msgspec.Meta(min_length=3, max_length=300)]
    protocol: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]


_decode_info = msgspec.msgpack.Decoder(_PeerInfo).decode


def import_engine() -> ModuleType:
    """`mooncake.engine`, imported with `MC_LOG_LEVEL` defaulting to WARNING."""
    # MC_LOG_LEVEL is read once, when the extension loads: set it before the first import.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    import mooncake.engine

    return mooncake.engine


class _Xfer:
    """A posted transfer: its descriptors, the batches submitted so far and its state."""

    __slots__ = ("op", "peer_id", "session", "local", "remote", "lengths", "batches", "submitted", "state",
                 "error", "kind", "running", "cancelled")

    def __init__(self, op: str, peer_id: str, session: str, local: np.ndarray, remote: np.ndarray,
                 lengths: np.ndarray, batch: int, state: TransferState):
        self.op = op
        self.peer_id = peer_id
        self.session = session
        self.local, self.remote, self.lengths = local, remote, lengths
        self.batches = -(-lengths.size // batch) if batch else 0
        self.submitted = 0  # batches handed to Mooncake, the failed one included
        self.state = state
        self.error, self.kind = "", ""  # why it failed, and the TransferError kind of that
        self.running = False  # a batch of it is inside Mooncake right now
        self.cancelled = False

    def __repr__(self) -> str:
        why = f" ({self.error})" if self.error else ""
        return (f"<mooncake {self.op} with {self.peer_id}: {self.state.value}{why}, "
                f"{self.submitted}/{self.batches} batches>")


class _Peer:
    """A peer: its session, regions, transfers not yet released, and the worker thread that runs them."""

    __slots__ = ("session", "pairing", "xfers", "jobs", "worker")

    def __init__(self, session: str, pairing: Pairing, jobs: queue.SimpleQueue, worker: threading.Thread):
        self.session = session
        self.pairing = pairing  # how its regions pair with ours, checked once at add_peer
        self.xfers: set[_Xfer] = set()
        self.jobs = jobs
        self.worker = worker


class MooncakeTransport(Transport):
    """Transport over a Mooncake Transfer Engine in P2P-handshake mode."""

    name = "mooncake"
    label = "Mooncake"

    def __init__(self, host: str = _DEFAULTS.host, *, protocol: str = _DEFAULTS.protocol, device: str = _DEFAULTS.device,
                 max_batch_entries: int = _DEFAULTS.max_batch_entries, close_timeout_s: float = _DEFAULTS.close_timeout_s):
        """Start the engine on `host` (an address peers can reach; a random RPC port is chosen).

        `protocol`: "tcp", or "rdma" on RDMA hosts (Mooncake installs RDMA by itself when it finds
        HCAs; `MC_FORCE_TCP=1` keeps it on TCP). `device`: comma-separated RDMA device filter ("" =
        all). `max_batch_entries`: most entries handed to Mooncake in one batch. `close_timeout_s`:
        how long `close()` waits for a batch still running.
        """
        try:
            check_transport_options("mooncake", dict(host=host, protocol=protocol, device=device,
                                                     max_batch_entries=max_batch_entries,
                                                     close_timeout_s=close_timeout_s))
        except KVConnectError as exc:
            raise LocalInvalid(str(exc)) from None
        engine_mod = import_engine()
        engine = engine_mod.TransferEngine()
        with mooncake_errors(f"could not start on {host} over {protocol}"):
            check_rc(engine.initialize(host, "P2PHANDSHAKE", protocol, device),
                      f"could not start on {host} over {protocol}", TransferError)
        self.host = host
        self.protocol = protocol
        self.max_batch_entries = max_batch_entries
        self.close_timeout_s = close_timeout_s
        self.session = f"{host}:{engine.get_rpc_port()}"
        self._vram_ok = bool(getattr(engine_mod, "SUPPORT_CUDA", False) or getattr(engine_mod, "SUPPORT_HIP", False))
        self._engine = engine
        self._lock = threading.RLock()
        self._regions: RegionSet | None = None
        self._registered: list[int] = []
        self._peers: dict[str, _Peer] = {}
        self._retired: list[threading.Thread] = []  # workers of removed peers, finishing their last batch
        self._session_locks: dict[str, threading.Lock] = {}
        _open.add(self)

    # ---- set-up ----

    def register(self, regions: RegionSet) -> None:
        """Register every region once (overlapping regions merged)."""
        with self._lock:
            self._check_registering()
            if MemoryKind.VRAM in regions.memory_kinds() and not self._vram_ok:
                raise LayoutError("this Mooncake build has no GPU support: VRAM regions cannot be registered "
                                  "(install the `mooncake` extra, not `mooncake-cpu`)")
            rows = regions.registration()
            addrs, sizes = rows[:, 0].tolist(), rows[:, 1].tolist()
            with mooncake_errors(f"could not register {regions}"):
                check_rc(self._engine.batch_register_memory(addrs, sizes), f"could not register {regions}")
            self._regions, self._registered = regions, addrs

    def local_metadata(self) -> bytes:
        """This engine's session name and protocol, msgpack-encoded, for peers' `add_peer`."""
        with self._lock:
            self._check_registered("handing out metadata")
            return msgspec.msgpack.encode(_PeerInfo(session=self.session, protocol=self.protocol))

    def add_peer(self, peer_id: str, metadata: bytes, regions: RegionSet | Pairing,
                 slices: PageSlices | None = None) -> None:
        """Make a peer addressable; nothing is sent until its first transfer opens the connection."""
        with self._lock:
            pairing = self._new_pairing(peer_id, regions, slices)
            info = _parse_metadata(peer_id, metadata)
            if info.protocol != self.protocol:
                raise RemoteRejected(f"peer {peer_id} runs Mooncake over {info.protocol}, this transport over "
                                    f"{self.protocol}")
            session_lock = self._session_locks.setdefault(info.session, threading.Lock())
            jobs: queue.SimpleQueue[_Xfer | None] = queue.SimpleQueue()
            # The worker holds its own reference to the engine, so the engine outlives any batch it runs.
            worker = spawn(_work, name=f"kvconnect-mooncake-{peer_id}",
                           args=(self._engine, jobs, session_lock, self.max_batch_entries))
            self._peers[peer_id] = _Peer(info.session, pairing, jobs, worker)

    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer; its transfers are cancelled (see `cancel`). Does not wait for a running batch."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is None:
                return
            self._retire(peer, "peer removed")
            self._retired = [w for w in self._retired if w.is_alive()]

    # ---- transfers ----

    def _post(self, peer_id: str, peer: _Peer, selection: Selection) -> _Xfer:
        """Queue a checked READ or WRITE for the peer's worker."""
        local, remote = peer.pairing.rows(selection)
        op = selection.op
        if local.shape[0] == 0:
            return _Xfer(op, peer_id, peer.session, local[:, 0], remote[:, 0], local[:, 1], 0, TransferState.DONE)
        xfer = _Xfer(op, peer_id, peer.session, local[:, 0], remote[:, 0], local[:, 1], self.max_batch_entries,
                     TransferState.PENDING)
        peer.xfers.add(xfer)
        peer.jobs.put(xfer)
        return xfer

    def poll(self, handle: object) -> TransferState:
        """DONE, PENDING or FAILED; a Mooncake failure (a dead peer included) is FAILED."""
        return self._xfer(handle).state

    def cancel(self, handle: object) -> None:
        """Submit no further batch; FAILED at once, or when the batch inside Mooncake returns."""
        _fail(self._xfer(handle), "cancelled")

    def release(self, handle: object) -> None:
        """Free the transfer (cancelling it if still pending)."""
        xfer = self._xfer(handle)
        with self._lock:
            peer = self._peers.get(xfer.peer_id)
            if peer is not None:
                peer.xfers.discard(xfer)
            _fail(xfer, "released")

    # ---- shutdown ----

    def close(self) -> None:
        """Fail what is pending, stop the workers (bounded wait), deregister memory, drop the engine."""
        if not self._lock.acquire(timeout=self.close_timeout_s):
            log.error("kvconnect mooncake: close() could not take the transport lock; leaving it open")
            return
        try:
            if self._closed:
                return
            self._closed = True
            _open.discard(self)
            for peer in self._peers.values():
                self._retire(peer, "transport closed")
            self._peers.clear()
            workers, self._retired = self._retired, []
        finally:
            self._lock.release()
        deadline = time.monotonic() + self.close_timeout_s
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join(max(0.0, deadline - time.monotonic()))
        if any(w.is_alive() for w in workers):
            # Memory a running batch still moves must stay registered; each worker's own reference keeps
            # the engine alive until its batch returns.
            log.error("kvconnect mooncake: a batch is still running after %.0f s; closing without "
                      "deregistering memory", self.close_timeout_s)
        elif self._registered:
            try:
                with mooncake_errors("could not deregister memory"):
                    check_rc(self._engine.batch_unregister_memory(self._registered), "could not deregister memory",
                              TransferError)
            except TransferError as exc:
                log.warning("kvconnect mooncake: %s", exc)
        self._registered = []
        self._engine = None

    # ---- internals ----

    def _xfer(self, handle: object) -> _Xfer:
        if not isinstance(handle, _Xfer):
            raise LocalInvalid(f"not a Mooncake transfer handle: {handle!r}")
        return handle

    def _retire(self, peer: _Peer, why: str) -> None:
        for xfer in peer.xfers:
            _fail(xfer, why)
        peer.xfers.clear()
        peer.jobs.put(None)
        self._retired.append(peer.worker)


def _work(engine: Any, jobs: queue.SimpleQueue, session_lock: threading.Lock, step: int) -> None:
    """A peer's worker: run its transfers in order, one Mooncake batch at a time, until the None sentinel."""
    calls: dict[str, Callable[..., int]] = {"READ": engine.batch_transfer_sync_read,
                                            "WRITE": engine.batch_transfer_sync_write}
    while True:
        xfer = jobs.get()
        if xfer is None:
            return
        try:
            _run(xfer, calls[xfer.op], session_lock, step)
        except Exception as exc:  # the worker must outlive any one transfer
            _end_batch(xfer, f"{type(exc).__name__}: {exc}", kind=error_class(exc).kind)
            log.warning("kvconnect mooncake: %s with %s failed: %s", xfer.op, xfer.peer_id, exc)


def _run(xfer: _Xfer, call: Callable[..., int], session_lock: threading.Lock, step: int) -> None:
    for start in range(0, xfer.lengths.size, step):
        with session_lock:
            # Checked and marked under the state lock: once cancel() returns, no further batch goes out.
            with _state_lock:
                if xfer.state is not TransferState.PENDING or xfer.cancelled:
                    return
                xfer.submitted += 1
                xfer.running = True
            stop = start + step
            t0 = time.monotonic()
            rc = call(xfer.session, xfer.local[start:stop].tolist(), xfer.remote[start:stop].tolist(),
                      xfer.lengths[start:stop].tolist())
        if rc != 0:
            # How long it ran tells a refused or reset connection (well under a second) from Mooncake's
            # own deadline, which it reports the same way and logs only at INFO.
            took = time.monotonic() - t0
            why = f"batch {xfer.submitted}/{xfer.batches} returned {rc} after {took:.1f} s"
            log.warning("kvconnect mooncake: %s with %s (%s) failed: %s", xfer.op, xfer.peer_id, xfer.session, why)
            _end_batch(xfer, why, kind=failed_batch_kind(rc, took))
            return
        _end_batch(xfer, None, last=stop >= xfer.lengths.size)


def _end_batch(xfer: _Xfer, error: str | None, last: bool = False, kind: str = "") -> None:
    """A batch returned: the transfer fails (error, or cancelled meanwhile), is done (last batch), or goes on."""
    with _state_lock:
        xfer.running = False
        if xfer.state is not TransferState.PENDING:
            return
        if error is not None or xfer.cancelled:
            xfer.state, xfer.error, xfer.kind = TransferState.FAILED, error or xfer.error, kind
        elif last:
            xfer.state = TransferState.DONE


def _fail(xfer: _Xfer, why: str) -> None:
    """Cancel: FAILED now if no batch of it is inside Mooncake, else when that batch returns."""
    with _state_lock:
        if xfer.state is not TransferState.PENDING:
            return
        xfer.cancelled, xfer.error = True, why
        if not xfer.running:
            xfer.state = TransferState.FAILED


def _parse_metadata(peer_id: str, metadata: bytes) -> _PeerInfo:
    if not isinstance(metadata, (bytes, bytearray, memoryview)) or len(metadata) > _MAX_METADATA_BYTES:
        raise RemoteRejected(f"peer {peer_id}: Mooncake metadata must be bytes of at most {_MAX_METADATA_BYTES}")
    try:
        info = _decode_info(metadata)
    except msgspec.DecodeError as exc:
        raise RemoteRejected(f"peer {peer_id}: not Mooncake transport metadata ({exc})") from exc
    if not _SESSION.fullmatch(info.session):
        raise RemoteRejected(f"peer {peer_id}: bad Mooncake session name {info.session!r}")
    return info
