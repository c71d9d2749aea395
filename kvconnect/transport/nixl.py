"""NIXL transport: one agent per worker, UCX by default, DRAM or VRAM regions.

Memory is registered once. At `register` every block of every region becomes one row of a prepared
local descriptor list; at `add_peer` the same is done for the peer's regions, as long as the peer's
blocks fit `prepared_rows` (then a post is two index arrays handed to `make_prepped_xfer`, no
descriptor built per request). A peer whose regions hold more blocks than that is not prepared:
its posts build their descriptors with numpy for exactly the blocks they move, so what a peer
claims to have never costs this process memory, only what it actually reads does. NIXL merges index
runs contiguous in memory on both sides into one descriptor. Between processes on one host UCX
copies with CMA inside `post` itself (the GIL is released meanwhile), so a post can take as long as
the copy; across hosts it returns at once and `poll` tracks the transfer.

Every NIXL call goes through `_nixl(what)`, which turns whatever NIXL raises into one TransferError
naming the operation. A peer process that dies shows up as NIXL_ERR_REMOTE_DISCONNECT on the post or
a later poll (FAILED); a peer host that vanishes without closing its sockets may stay PENDING until
UCX times out, so callers keep a deadline of their own.

NIXL cannot recall a transfer: releasing a pending UCX request, or removing its peer's agent, returns
at once while the bytes still arrive afterwards (seen here with UCX over TCP: a READ released while
its peer was stopped wrote its buffer after the peer resumed, over a later READ into the same
blocks). So `cancel` only marks a transfer, which reads FAILED once NIXL itself reports it over, and
a removed peer keeps its agent until its transfers are over. A transfer to a peer that hangs without
dying stays PENDING until the peer resumes or its connection fails.

Shutdown order matters to NIXL: transfer handles, prepared lists, remote agents, registrations, and
only then the agent. `close()` does that, and runs at interpreter exit for any transport left open.
The memory behind the registered regions must stay allocated until `close()`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import uuid
import weakref
from typing import Sequence

import numpy as np

from kvconnect.errors import LayoutError, TransferError
from kvconnect.regions import BlockIds, MemoryKind, RegionSet
from kvconnect.shards import PageSlices
from kvconnect.transport.base import RegionIndices, TransferState, Transport, mapped_errors, paired_descriptors
from kvconnect.threads import spawn

log = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING}
# Blocks of a peer prepared up front: 24 bytes of numpy plus about 8 of NIXL per block, 64 MiB in all.
DEFAULT_PREPARED_ROWS = 2 << 20
_open: weakref.WeakSet[NixlTransport] = weakref.WeakSet()
# Agents closed while a transfer was still writing their memory: kept alive until the process exits.
_unfinished: list[object] = []


@atexit.register
def _close_open_transports() -> None:
    for transport in list(_open):
        transport.close()


def skip_ucx_ib_without_devices() -> None:
    """Keep UCX from loading its InfiniBand module on a host that has no RDMA device.

    Some hosts ship rdma-core's userspace libraries without any RDMA device; there UCX's ib module
    pulls a second copy of libnl into the process and its destructor was seen to crash the process at
    exit. Without a device the module has nothing to do. An explicit UCX_MODULES is left alone.
    """
    if "UCX_MODULES" in os.environ:
        return
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if not devices:
        os.environ["UCX_MODULES"] = "^ib"


def _nixl(what: str) -> contextlib.AbstractContextManager[None]:
    """Every NIXL call runs inside this: whatever the library raises becomes a TransferError naming `what`."""
    return mapped_errors("NIXL", what)


def _quietly(what: str, fn, *args) -> bool:
    """Run a NIXL clean-up call; log and return False if it fails (clean-up goes on regardless)."""
    try:
        with _nixl(what):
            fn(*args)
        return True
    except TransferError as exc:
        log.warning("kvconnect nixl: %s", exc)
        return False


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
    """A posted transfer: the NIXL handle (None once released), its peer, its state and what was asked of it."""

    __slots__ = ("handle", "peer", "peer_id", "state", "cancelled", "released")

    def __init__(self, handle: object, peer: _Peer | None, peer_id: str, state: TransferState):
        self.handle = handle
        self.peer = peer
        self.peer_id = peer_id
        self.state = state
        self.cancelled = False  # asked to stop: reads FAILED once NIXL says it is over
        self.released = False  # the caller let go: the handle is freed once NIXL says it is over

    def __repr__(self) -> str:
        return f"<nixl transfer with {self.peer_id}: {self.state.value}>"


class _Peer:
    __slots__ = ("agent", "regions", "kind", "slices", "offsets", "dlist", "xfers")

    def __init__(self, agent: str, regions: RegionSet, kind: MemoryKind, slices: PageSlices | None):
        self.agent = agent
        self.regions = regions
        self.kind = kind
        self.slices = slices
        self.offsets: np.ndarray | None = None
        self.dlist: object = None  # prepared list of every peer block, when within the budget
        self.xfers: set[_Xfer] = set()  # not yet released


class NixlTransport(Transport):
    """Transport over a NIXL agent (UCX unless `backends` says otherwise).

    A side that others read from or write to must make progress on its own, or their transfers stall
    (UCX over TCP or shared memory needs the target to answer). NIXL's progress thread does that but
    spins a whole core even when idle (measured: 5.0 CPU-seconds in 5 idle seconds), which on a small
    host starves the engine. kvconnect instead calls into NIXL every `progress_interval_s` on a thread
    of its own (measured idle cost: about 5% of a core at 0.5 ms, 3% at 1 ms). A side that only
    initiates and polls needs neither (`progress_interval_s=0`).
    """

    name = "nixl"
    label = "NIXL"

    def __init__(self, agent_name: str | None = None, *, backends: Sequence[str] = ("UCX",),
                 num_threads: int = 4, progress_thread: bool = False, progress_interval_s: float = 0.0005,
                 prepared_rows: int = DEFAULT_PREPARED_ROWS):
        """Create the agent; with neither progress thread nor interval this side must only initiate and poll.

        `num_threads` UCX workers share a post's descriptors: with per-block descriptors (random block
        tables) 4 of them pulled 2.4-3.3 GB/s where one pulled 1.0-1.3 on a 2-core host, at no idle cost.
        `prepared_rows`: peers with at most this many blocks in all get a prepared descriptor list.
        """
        import nixl._api as nixl_api

        if "UCX" in backends:
            skip_ucx_ib_without_devices()
        self.agent_name = agent_name or f"kvconnect-{uuid.uuid4().hex[:12]}"
        self.prepared_rows = int(prepared_rows)
        config = nixl_api.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends),
                                            num_threads=num_threads)
        with _nixl(f"could not create an agent with backends {list(backends)}"):
            self._agent = nixl_api.nixl_agent(self.agent_name, config)
        if not self._agent.backends:
            raise TransferError(f"none of the NIXL backends {list(backends)} is available "
                                f"(plugins: {self._agent.get_plugin_list()})")
        self._lock = threading.RLock()
        self._regions: RegionSet | None = None
        self._kind = MemoryKind.DRAM
        self._reg: object = None
        self._dlist: object = None
        self._offsets = np.zeros(0, dtype=np.int64)
        self._peers: dict[str, _Peer] = {}
        self._agents: dict[str, int] = {}  # remote agent -> peer ids using it (NIXL holds one entry per agent)
        self._retiring: list[_Peer] = []  # removed peers whose transfers NIXL has not finished yet
        self._pump: threading.Thread | None = None
        if progress_interval_s > 0 and not progress_thread:
            self._pump = spawn(self._progress, name=f"kvconnect-nixl-progress-{self.agent_name}",
                               args=(progress_interval_s,))
        _open.add(self)

    def _progress(self, interval_s: float) -> None:
        """Let NIXL make progress on transfers that peers aimed at this side, until close."""
        while not self._closed:
            with self._lock:
                if self._agent is None:
                    return
                try:
                    self._agent.get_new_notifs()  # progresses every backend; kvconnect sends no notifications
                except Exception as exc:  # the pump must outlive a backend hiccup
                    log.warning("kvconnect nixl: progress failed: %s", exc)
            time.sleep(interval_s)

    # ---- set-up ----

    def register(self, regions: RegionSet) -> None:
        """Register every region once and prepare the local per-block descriptor list."""
        with self._lock:
            self._check_registering()
            kind = _memory_kind(regions, "local")
            rows, offsets = _block_table(regions)
            if rows.shape[0] > np.iinfo(np.int32).max:
                raise LayoutError(f"{rows.shape[0]} blocks in all regions: NIXL indexes descriptors with int32")
            try:
                with _nixl(f"could not register {regions}"):
                    self._reg = self._agent.register_memory(regions.registration(), kind.value)
                    self._dlist = self._agent.prep_xfer_dlist(_LOCAL, rows, kind.value)
            except TransferError:
                self._undo_register()
                raise
            self._regions, self._offsets, self._kind = regions, offsets, kind

    def local_metadata(self) -> bytes:
        """The agent's metadata (connection info and registrations) for peers' `add_peer`."""
        with self._lock:
            self._check_registered("handing out metadata")
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, peer_id: str, metadata: bytes, regions: RegionSet, slices: PageSlices | None = None) -> None:
        """Load a peer agent and, within the budget, prepare its block list (not for a peer paired by
        slices: the local list holds whole blocks, so its posts build descriptors for their ranges)."""
        with self._lock:
            self._check_new_peer(peer_id, regions, slices)
            kind = _memory_kind(regions, f"peer {peer_id}")
            peer = _Peer(self._load_agent(peer_id, metadata), regions, kind, slices)
            try:
                if slices is None and sum(r.num_blocks for r in regions) <= self.prepared_rows:
                    rows, peer.offsets = _block_table(regions)
                    with _nixl(f"could not prepare peer {peer_id}'s blocks"):
                        peer.dlist = self._agent.prep_xfer_dlist(peer.agent, rows, kind.value)
            except TransferError:
                self._unload_agent(peer.agent)
                raise
            self._peers[peer_id] = peer

    def _load_agent(self, peer_id: str, metadata: bytes) -> str:
        """The NIXL agent of a peer's metadata, counted once more.

        NIXL keeps one entry per agent name and loads the same metadata again without complaint (a
        different blob under a known name is refused), so two peer ids that present one agent (a
        listener replaying a producer's metadata, say) share the entry: neither can remove it from
        under the other.
        """
        if bytes(metadata) == bytes(self._agent.get_agent_metadata()):
            agent = self.agent_name  # loopback: NIXL addresses its own memory by its own name
        else:
            with _nixl(f"refused the metadata of peer {peer_id}"):
                loaded = self._agent.add_remote_agent(metadata)
            agent = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._agents[agent] = self._agents.get(agent, 0) + 1
        return agent

    def _unload_agent(self, agent: str) -> None:
        left = self._agents.get(agent, 1) - 1
        if left > 0:
            self._agents[agent] = left
            return
        self._agents.pop(agent, None)
        if agent != self.agent_name:
            _quietly(f"removing agent {agent}", self._agent.remove_remote_agent, agent)

    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer: its transfers are cancelled; its agent goes once NIXL has finished them."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is None or self._closed:
                return
            for xfer in peer.xfers:
                xfer.cancelled = True
            self._retiring.append(peer)
            self._reap()

    # ---- transfers ----

    def post(self, op: str, peer_id: str, local_ids: BlockIds, remote_ids: BlockIds, *,
             regions: RegionIndices = None) -> _Xfer:
        """Post a READ or WRITE of these blocks; every id is checked before NIXL sees any."""
        with self._lock:
            peer, sel, lids, rids = self._checked_post(op, peer_id, local_ids, remote_ids, regions)
            if lids.size == 0 or sel.size == 0:
                return _Xfer(None, None, peer_id, TransferState.DONE)
            what = f"{op} of {lids.size * sel.size} blocks with {peer_id}"
            with _nixl(f"could not make a {what}"):
                if peer.dlist is not None:
                    handle = self._agent.make_prepped_xfer(op, self._dlist, _indices(self._offsets, sel, lids),
                                                           peer.dlist, _indices(peer.offsets, sel, rids), b"")
                else:
                    local, remote = paired_descriptors(self._regions, lids, peer.regions, rids, sel, peer.slices)
                    handle = self._agent.initialize_xfer(op, self._agent.get_xfer_descs(local, self._kind.value),
                                                         self._agent.get_xfer_descs(remote, peer.kind.value),
                                                         peer.agent, b"")
            try:
                with _nixl(f"{what} failed when posted"):
                    status = self._agent.transfer(handle)
                if status not in _STATES:
                    raise TransferError(f"NIXL {what} failed when posted ({status})")
            except TransferError:
                _quietly("releasing a transfer handle", self._agent.release_xfer_handle, handle)
                raise
            xfer = _Xfer(handle, peer, peer_id, _STATES[status])
            peer.xfers.add(xfer)
            return xfer

    def poll(self, handle: object) -> TransferState:
        """DONE, PENDING or FAILED; a NIXL error (a dead peer included) is FAILED."""
        xfer = self._xfer(handle)
        if xfer.state is not TransferState.PENDING:
            return xfer.state
        with self._lock:
            self._refresh(xfer)
            if self._retiring:
                self._reap()
            return xfer.state

    def cancel(self, handle: object) -> None:
        """Ask a transfer to stop. NIXL cannot recall bytes already on their way (a released UCX request
        still writes its buffer), so the transfer reads FAILED only once NIXL reports it over."""
        xfer = self._xfer(handle)
        with self._lock:
            if xfer.state is TransferState.PENDING:
                xfer.cancelled = True

    def release(self, handle: object) -> None:
        """Free the transfer's handle; a pending one is cancelled and freed once NIXL reports it over."""
        xfer = self._xfer(handle)
        with self._lock:
            xfer.released = True
            if xfer.state is TransferState.PENDING:
                xfer.cancelled = True
                self._refresh(xfer)
            if xfer.state is not TransferState.PENDING:
                self._free(xfer)

    # ---- shutdown ----

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel everything, wait (bounded) for NIXL to finish what is in flight, then release handles and
        prepared lists, remove peers, deregister memory and drop the agent."""
        # A thread stuck inside NIXL must not hang interpreter exit: give up on the lock after a while.
        if not self._lock.acquire(timeout=timeout_s):
            log.error("kvconnect nixl: close() could not take the transport lock; leaving it open")
            return
        try:
            if self._closed:
                return
            self._closed = True
            _open.discard(self)
            for peer in self._peers.values():
                for xfer in peer.xfers:
                    xfer.cancelled = True
                self._retiring.append(peer)
            self._peers.clear()
            deadline = time.monotonic() + timeout_s
            while self._reap() and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._retiring:
                # Memory a READ may still write must stay registered: keep the agent, leave it to process exit.
                log.error("kvconnect nixl: transfers still running after %.0f s; closing without deregistering "
                          "memory", timeout_s)
                _unfinished.append(self._agent)
            else:
                self._undo_register()
            self._agent = None
        finally:
            self._lock.release()

    # ---- internals (called with the lock held) ----

    def _xfer(self, handle: object) -> _Xfer:
        if not isinstance(handle, _Xfer):
            raise TransferError(f"not a NIXL transfer handle: {handle!r}")
        return handle

    def _refresh(self, xfer: _Xfer) -> None:
        """Ask NIXL where a pending transfer stands; final once NIXL says DONE or fails it."""
        if xfer.handle is None or self._agent is None:
            xfer.state = TransferState.FAILED
            return
        try:
            with _nixl(f"transfer with {xfer.peer_id}"):
                status = self._agent.check_xfer_state(xfer.handle)
        except TransferError as exc:
            log.warning("kvconnect nixl: %s", exc)
            status = "ERR"
        state = _STATES.get(status, TransferState.FAILED)
        if state is TransferState.DONE and xfer.cancelled:
            state = TransferState.FAILED
        xfer.state = state

    def _free(self, xfer: _Xfer) -> None:
        """Release a finished transfer's handle and forget it."""
        if xfer.handle is not None and self._agent is not None:
            _quietly(f"releasing a transfer with {xfer.peer_id}", self._agent.release_xfer_handle, xfer.handle)
        xfer.handle = None
        if xfer.peer is not None:
            xfer.peer.xfers.discard(xfer)

    def _reap(self) -> bool:
        """Finish removing peers whose transfers are all over; True while some are still running."""
        still = []
        for peer in self._retiring:
            for xfer in list(peer.xfers):
                if xfer.state is TransferState.PENDING:
                    self._refresh(xfer)
                if xfer.state is not TransferState.PENDING:
                    self._free(xfer)
            if peer.xfers:
                still.append(peer)
                continue
            if peer.dlist is not None:
                _quietly("releasing a peer's prepared list", self._agent.release_dlist_handle, peer.dlist)
            self._unload_agent(peer.agent)
        self._retiring = still
        return bool(still)

    def _undo_register(self) -> None:
        if self._dlist is not None:
            _quietly("releasing the local prepared list", self._agent.release_dlist_handle, self._dlist)
            self._dlist = None
        if self._reg is not None:
            _quietly("deregistering memory", self._agent.deregister_memory, self._reg)
            self._reg = None
