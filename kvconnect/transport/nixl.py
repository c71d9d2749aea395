"""NIXL transport: one agent per worker, UCX by default, DRAM or VRAM regions.

Memory is registered once. At `register` every block of every region becomes one row of a prepared
local descriptor list; at `add_peer` the same is done for the peer's regions. A post is then two
index arrays (region offset + block id, built with numpy) handed to `make_prepped_xfer`: no
descriptor is built per request and nothing loops per block in Python. NIXL merges index runs that
are contiguous in memory on both sides into one descriptor when it makes the request. Between
processes on one host UCX copies with CMA inside `post` itself (the GIL is released meanwhile), so a
post can take as long as the copy; across hosts it returns at once and `poll` tracks the transfer.
The memory behind the registered regions must stay allocated until `close()`: a `RegionSet` holds
addresses, not tensors.

Errors raised by NIXL become `TransferError` when posting and FAILED when polling. When a peer
process dies, UCX reports it (NIXL_ERR_REMOTE_DISCONNECT) on the post or on a later poll; a peer host
that vanishes without closing its sockets may instead stay PENDING until UCX times out, so callers
keep a deadline of their own.

Shutdown order matters to NIXL: transfer handles, prepared lists, remote agents, registrations,
and only then the agent. `close()` does that, and runs at interpreter exit for any transport left open.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
import weakref
from typing import Sequence

import numpy as np

from kvconnect.errors import LayoutError, TransferError
from kvconnect.regions import BlockIds, MemoryKind, RegionSet
from kvconnect.transport.base import RegionIndices, TransferState, Transport, check_peer_regions, check_post

log = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING}
_open: weakref.WeakSet[NixlTransport] = weakref.WeakSet()


@atexit.register
def _close_open_transports() -> None:
    for transport in list(_open):
        transport.close()


def skip_ucx_ib_without_devices() -> None:
    """Keep UCX from loading its InfiniBand module on a host that has no RDMA device.

    With rdma-core installed system-wide, that module pulls a second copy of libnl into the process,
    and its destructor crashes the process at exit. Without a device the module has nothing to do.
    An explicit UCX_MODULES is left alone.
    """
    if "UCX_MODULES" in os.environ:
        return
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if not devices:
        os.environ["UCX_MODULES"] = "^ib"


def _block_table(regions: RegionSet) -> tuple[np.ndarray, np.ndarray]:
    """One `(addr, nbytes, device)` row per block, region-major, and each region's first row index."""
    counts = np.array([r.num_blocks for r in regions], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rows = np.empty((int(counts.sum()), 3), dtype=np.uint64)
    for r, start in zip(regions, offsets.tolist()):
        block = np.arange(r.num_blocks, dtype=np.uint64)
        rows[start:start + r.num_blocks, 0] = np.uint64(r.base_addr) + block * np.uint64(r.block_stride)
        rows[start:start + r.num_blocks, 1] = r.block_bytes
        rows[start:start + r.num_blocks, 2] = r.device_id
    if rows.shape[0] > np.iinfo(np.int32).max:
        raise LayoutError(f"{rows.shape[0]} blocks in all regions: NIXL indexes descriptors with int32")
    return rows, offsets


def _memory_kind(regions: RegionSet, whose: str) -> MemoryKind:
    kinds = regions.memory_kinds()
    if len(kinds) != 1:
        raise LayoutError(f"{whose} regions mix memory kinds {sorted(k.value for k in kinds)}; "
                          "the NIXL transport moves one kind per side")
    return next(iter(kinds))


def _indices(offsets: np.ndarray, sel: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return (offsets[sel][:, None] + ids[None, :]).ravel().astype(np.int32)


class _Xfer:
    """A posted transfer: the NIXL handle (None once released), its peer and its last known state."""

    __slots__ = ("handle", "peer_id", "state")

    def __init__(self, handle: object, peer_id: str, state: TransferState):
        self.handle = handle
        self.peer_id = peer_id
        self.state = state

    def __repr__(self) -> str:
        return f"<nixl transfer to {self.peer_id}: {self.state.value}>"


class _Peer:
    __slots__ = ("agent", "regions", "offsets", "dlist", "xfers")

    def __init__(self, agent: str, regions: RegionSet, offsets: np.ndarray, dlist: object):
        self.agent = agent
        self.regions = regions
        self.offsets = offsets
        self.dlist = dlist
        self.xfers: set[_Xfer] = set()


class NixlTransport(Transport):
    """Transport over a NIXL agent (UCX unless `backends` says otherwise).

    NIXL's progress thread spins a whole core. A peer only makes progress on transfers aimed at it
    (and on their notifications) through that thread or through its own calls into NIXL, so a side
    that others read from or write to keeps `progress_thread=True`; a side that only initiates and
    polls can turn it off.
    """

    name = "nixl"
    label = "NIXL"

    def __init__(self, agent_name: str | None = None, *, backends: Sequence[str] = ("UCX",),
                 num_threads: int = 4, progress_thread: bool = True):
        """Create the agent; without `progress_thread` this side must only initiate, and keep polling.

        `num_threads` UCX workers share a post's descriptors: with per-block descriptors (random block
        tables) 4 of them pulled 2.4-3.3 GB/s where one pulled 1.0-1.3 on a 2-core host, at no idle cost.
        """
        import nixl._api as nixl_api

        if "UCX" in backends:
            skip_ucx_ib_without_devices()
        self.agent_name = agent_name or f"kvconnect-{uuid.uuid4().hex[:12]}"
        config = nixl_api.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends),
                                            num_threads=num_threads)
        try:
            self._agent = nixl_api.nixl_agent(self.agent_name, config)
        except Exception as exc:
            raise TransferError(f"cannot create NIXL agent with backends {list(backends)}: {exc}") from exc
        if not self._agent.backends:
            raise TransferError(f"none of the NIXL backends {list(backends)} is available "
                                f"(plugins: {self._agent.get_plugin_list()})")
        self._lock = threading.RLock()
        self._closed = False
        self._regions: RegionSet | None = None
        self._reg: object = None
        self._dlist: object = None
        self._offsets = np.zeros(0, dtype=np.int64)
        self._peers: dict[str, _Peer] = {}
        _open.add(self)

    # ---- set-up ----

    def register(self, regions: RegionSet) -> None:
        """Register every region once and prepare the local per-block descriptor list."""
        with self._lock:
            self._check_open()
            if self._regions is not None:
                raise TransferError("this transport already registered its regions")
            kind = _memory_kind(regions, "local")
            rows, offsets = _block_table(regions)
            try:
                self._reg = self._agent.register_memory(regions.registration(), kind.value)
                self._dlist = self._agent.prep_xfer_dlist(_LOCAL, rows, kind.value)
            except Exception as exc:
                self._undo_register()
                raise TransferError(f"NIXL could not register {regions}: {exc}") from exc
            self._regions, self._offsets = regions, offsets

    def local_metadata(self) -> bytes:
        """The agent's metadata (connection info and registrations) for peers' `add_peer`."""
        with self._lock:
            self._check_open()
            if self._regions is None:
                raise TransferError("register regions before handing out metadata")
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, peer_id: str, metadata: bytes, regions: RegionSet) -> None:
        """Load a peer agent from its metadata and prepare its per-block descriptor list."""
        with self._lock:
            self._check_open()
            if self._regions is None:
                raise TransferError("register regions before adding peers")
            check_peer_regions(self._regions, regions)
            kind = _memory_kind(regions, f"peer {peer_id}")
            rows, offsets = _block_table(regions)
            self.remove_peer(peer_id)
            if bytes(metadata) == bytes(self._agent.get_agent_metadata()):
                agent = self.agent_name  # loopback: NIXL addresses its own memory by its own name
            else:
                try:
                    agent = self._agent.add_remote_agent(metadata)
                except Exception as exc:
                    raise TransferError(f"NIXL refused the metadata of peer {peer_id}: {exc}") from exc
                if isinstance(agent, bytes):
                    agent = agent.decode()
                if any(p.agent == agent for p in self._peers.values()):
                    # One NIXL entry per agent: a second peer id for it would lose it on the first removal.
                    raise TransferError(f"peer {peer_id}: agent {agent} is already added under another peer id")
            try:
                dlist = self._agent.prep_xfer_dlist(agent, rows, kind.value)
            except Exception as exc:
                self._forget_agent(agent)
                raise TransferError(f"NIXL could not prepare peer {peer_id}'s blocks: {exc}") from exc
            self._peers[peer_id] = _Peer(agent, regions, offsets, dlist)

    def remove_peer(self, peer_id: str) -> None:
        """Release the peer's transfers and prepared list, then drop its agent."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is None or self._closed:
                return
            self._drop_peer(peer_id, peer)

    # ---- transfers ----

    def post(self, op: str, peer_id: str, local_ids: BlockIds, remote_ids: BlockIds, *,
             regions: RegionIndices = None, notif: bytes = b"") -> _Xfer:
        """Post a READ or WRITE of these blocks; every id is checked before NIXL sees any."""
        with self._lock:
            self._check_open()
            peer = self._peer(peer_id)
            if self._regions is None:
                raise TransferError("register regions before posting")
            sel, lids, rids = check_post(op, self._regions, local_ids, peer.regions, remote_ids, regions)
            if lids.size == 0 or sel.size == 0:
                if notif:
                    self.notify(peer_id, notif)
                return _Xfer(None, peer_id, TransferState.DONE)
            lidx = _indices(self._offsets, sel, lids)
            ridx = _indices(peer.offsets, sel, rids)
            try:
                handle = self._agent.make_prepped_xfer(op, self._dlist, lidx, peer.dlist, ridx, notif)
            except Exception as exc:
                raise TransferError(f"NIXL could not make a {op} of {lidx.size} blocks with {peer_id}: "
                                    f"{exc}") from exc
            try:
                status = self._agent.transfer(handle)
            except Exception as exc:
                self._release_handle(handle)
                raise TransferError(f"NIXL {op} with {peer_id} failed when posted: {exc}") from exc
            if status not in _STATES:
                self._release_handle(handle)
                raise TransferError(f"NIXL {op} with {peer_id} failed when posted ({status})")
            xfer = _Xfer(handle, peer_id, _STATES[status])
            peer.xfers.add(xfer)
            return xfer

    def poll(self, handle: object) -> TransferState:
        """DONE, PENDING or FAILED; a NIXL error (a dead peer included) is FAILED."""
        xfer = self._xfer(handle)
        if xfer.state is not TransferState.PENDING:
            return xfer.state
        with self._lock:
            if xfer.handle is None or self._closed:
                xfer.state = TransferState.FAILED
                return xfer.state
            try:
                status = self._agent.check_xfer_state(xfer.handle)
            except Exception as exc:
                log.warning("kvconnect nixl: transfer with %s failed: %s", xfer.peer_id, exc)
                status = "ERR"
            xfer.state = _STATES.get(status, TransferState.FAILED)
            return xfer.state

    def release(self, handle: object) -> None:
        """Free the transfer; one still in flight is cancelled (and then reads FAILED)."""
        xfer = self._xfer(handle)
        with self._lock:
            peer = self._peers.get(xfer.peer_id)
            if peer is not None:
                peer.xfers.discard(xfer)
            self._release_xfer(xfer)

    # ---- notifications ----

    def notify(self, peer_id: str, message: bytes) -> None:
        """Send a standalone notification to a peer."""
        with self._lock:
            self._check_open()
            peer = self._peer(peer_id)
            try:
                self._agent.send_notif(peer.agent, message)
            except Exception as exc:
                raise TransferError(f"NIXL could not notify {peer_id}: {exc}") from exc

    def notifications(self) -> list[tuple[str, bytes]]:
        """Messages received since the last call; senders not added as peers appear by agent name."""
        with self._lock:
            if self._closed:
                return []
            try:
                received = self._agent.get_new_notifs()
            except Exception as exc:
                log.warning("kvconnect nixl: reading notifications failed: %s", exc)
                return []
            by_agent = {p.agent: pid for pid, p in self._peers.items()}
            return [(by_agent.get(agent, agent), bytes(m)) for agent, msgs in received.items() for m in msgs]

    # ---- shutdown ----

    def close(self) -> None:
        """Release handles and prepared lists, remove peers, deregister memory, then drop the agent."""
        # A thread stuck inside NIXL must not hang interpreter exit: give up on the lock after a while.
        if not self._lock.acquire(timeout=30.0):
            log.error("kvconnect nixl: close() could not take the transport lock; leaving it open")
            return
        try:
            if self._closed:
                return
            self._closed = True
            _open.discard(self)
            for peer_id, peer in list(self._peers.items()):
                self._drop_peer(peer_id, peer)
            self._peers.clear()
            self._undo_register()
            self._agent = None
        finally:
            self._lock.release()

    # ---- internals (called with the lock held) ----

    def _xfer(self, handle: object) -> _Xfer:
        if not isinstance(handle, _Xfer):
            raise TransferError(f"not a NIXL transfer handle: {handle!r}")
        return handle

    def _release_handle(self, handle: object) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # NIXL keeps an uncancellable handle and frees it with the agent
            log.warning("kvconnect nixl: releasing a transfer handle failed: %s", exc)

    def _release_xfer(self, xfer: _Xfer) -> None:
        if xfer.handle is None:
            return
        if xfer.state is TransferState.PENDING:
            xfer.state = TransferState.FAILED
        handle, xfer.handle = xfer.handle, None
        if self._agent is not None:
            self._release_handle(handle)

    def _drop_peer(self, peer_id: str, peer: _Peer) -> None:
        for xfer in list(peer.xfers):
            self._release_xfer(xfer)
        peer.xfers.clear()
        try:
            self._agent.release_dlist_handle(peer.dlist)
        except Exception as exc:
            log.warning("kvconnect nixl: releasing peer %s's prepared list failed: %s", peer_id, exc)
        self._forget_agent(peer.agent)

    def _forget_agent(self, agent: str) -> None:
        if agent == self.agent_name:
            return
        try:
            self._agent.remove_remote_agent(agent)
        except Exception as exc:
            log.warning("kvconnect nixl: removing remote agent %s failed: %s", agent, exc)

    def _undo_register(self) -> None:
        if self._dlist is not None:
            try:
                self._agent.release_dlist_handle(self._dlist)
            except Exception as exc:
                log.warning("kvconnect nixl: releasing the local prepared list failed: %s", exc)
            self._dlist = None
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                log.warning("kvconnect nixl: deregistering memory failed: %s", exc)
            self._reg = None
