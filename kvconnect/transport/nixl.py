"""NIXL transport: one agent per worker, UCX by default, DRAM or VRAM regions.

Memory is registered once. At `register` every block of every region becomes one row of a prepared
local descriptor list (`kvconnect.descriptors.block_table`); at `add_peer` the same is done for the
peer's regions if its blocks fit `prepared_rows` (a post is then two index arrays handed to
`make_prepped_xfer`). A larger peer is not prepared: its posts build rows for exactly the blocks they
move, so what a peer claims to have never costs this process memory. NIXL merges index runs
contiguous on both sides into one descriptor. On one host UCX copies with CMA inside `post` itself
(the GIL released), so a post can take as long as the copy; across hosts `poll` tracks it.

Every NIXL call runs inside `nixl_errors(what)`, which maps what NIXL raises to a typed TransferError.
A peer process that dies shows up as NIXL_ERR_REMOTE_DISCONNECT on the post or a later poll (FAILED);
a peer host that vanishes without closing its sockets may stay PENDING until UCX times out.

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
import logging
import threading
import time
import uuid
import weakref
from typing import Sequence

import numpy as np

from kvconnect.descriptors import Pairing, Selection, block_table, table_indices
from kvconnect.errors import LayoutError, LocalInvalid, TransferError
from kvconnect.regions import MemoryKind, RegionSet
from kvconnect.shards import PageSlices
from kvconnect.threads import spawn
from kvconnect.transport.base import TransferState, Transport
from kvconnect.transport.nixl_agents import RemoteAgents
from kvconnect.transport.nixl_errors import nixl_errors, quietly
from kvconnect.transport.options import DEFAULT_PREPARED_ROWS, NixlOptions
from kvconnect.transport.ucx import skip_ucx_ib_without_devices

__all__ = ["DEFAULT_PREPARED_ROWS", "NixlTransport", "skip_ucx_ib_without_devices"]  # the last two: re-exported

log = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING}
_DEFAULTS = NixlOptions()
_open: weakref.WeakSet[NixlTransport] = weakref.WeakSet()
# Agents closed while a transfer was still writing their memory: kept alive until the process exits.
_unfinished: list[object] = []


@atexit.register
def _close_open_transports() -> None:
    for transport in list(_open):
        transport.close()


def _memory_kind(regions: RegionSet, whose: str) -> MemoryKind:
    kinds = regions.memory_kinds()
    if len(kinds) != 1:
        raise LayoutError(f"{whose} regions mix memory kinds {sorted(k.value for k in kinds)}; "
                          "the NIXL transport moves one kind per side")
    return next(iter(kinds))


class _Xfer:
    """A posted transfer: the NIXL handle (None once released), its peer, its state and what was asked of it."""

    __slots__ = ("handle", "peer", "peer_id", "state", "cancelled", "released", "kind")

    def __init__(self, handle: object, peer: _Peer | None, peer_id: str, state: TransferState):
        self.handle = handle
        self.peer = peer
        self.peer_id = peer_id
        self.state = state
        self.cancelled = False  # asked to stop: reads FAILED once NIXL says it is over
        self.released = False  # the caller let go: the handle is freed once NIXL says it is over
        self.kind = ""  # the TransferError kind NIXL failed it with, when it said

    def __repr__(self) -> str:
        return f"<nixl transfer with {self.peer_id}: {self.state.value}>"


class _Peer:
    __slots__ = ("agent", "pairing", "kind", "offsets", "dlist", "xfers")

    def __init__(self, agent: str, pairing: Pairing, kind: MemoryKind):
        self.agent = agent
        self.pairing = pairing  # how its regions pair with ours, checked once at add_peer
        self.kind = kind
        self.offsets: np.ndarray | None = None
        self.dlist: object = None  # prepared list of every peer block, when within the budget
        self.xfers: set[_Xfer] = set()  # not yet released


class NixlTransport(Transport):
    """Transport over a NIXL agent (UCX unless `backends` says otherwise).

    A side that others read from or write to must make progress on its own, or their transfers stall
    (UCX over TCP or shared memory needs the target to answer). NIXL's progress thread does that but
    spins a whole core even when idle (measured: 5.0 CPU-seconds in 5 idle seconds), which on a small
    host starves the engine. kvconnect instead calls into NIXL every `progress_interval_s` on a thread
    of its own (measured idle cost: about 5% of a core at 0.5 ms, 3% at 1 ms). It keeps that pace
    when no peer reads: calling every 20 ms between claims (a claim waking it at once) made SGLang's
    time to first token over NIXL twice as long on a 2-core host. A side that only initiates and polls
    needs neither (`progress_interval_s=0`).
    """

    name = "nixl"
    label = "NIXL"

    def __init__(self, agent_name: str | None = _DEFAULTS.agent_name, *,
                 backends: Sequence[str] = _DEFAULTS.backends, num_threads: int = _DEFAULTS.num_threads,
                 progress_thread: bool = _DEFAULTS.progress_thread,
                 progress_interval_s: float = _DEFAULTS.progress_interval_s,
                 prepared_rows: int = _DEFAULTS.prepared_rows):
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
        with nixl_errors(f"could not create an agent with backends {list(backends)}"):
            self._agent = nixl_api.nixl_agent(self.agent_name, config)
        if not self._agent.backends:
            raise LocalInvalid(f"none of the NIXL backends {list(backends)} is available "
                                f"(plugins: {self._agent.get_plugin_list()})")
        self._lock = threading.RLock()
        self._regions: RegionSet | None = None
        self._kind = MemoryKind.DRAM
        self._reg: object = None
        self._dlist: object = None
        self._offsets = np.zeros(0, dtype=np.int64)
        self._peers: dict[str, _Peer] = {}
        self._agents = RemoteAgents(self._agent, self.agent_name)
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
            rows, offsets = block_table(regions)
            if rows.shape[0] > np.iinfo(np.int32).max:
                raise LayoutError(f"{rows.shape[0]} blocks in all regions: NIXL indexes descriptors with int32")
            try:
                with nixl_errors(f"could not register {regions}"):
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

    def add_peer(self, peer_id: str, metadata: bytes, regions: RegionSet | Pairing,
                 slices: PageSlices | None = None) -> None:
        """Load a peer agent and, within the budget, prepare its block list (not for a peer paired by
        slices: the local list holds whole blocks, so its posts build descriptors for their ranges)."""
        with self._lock:
            pairing = self._new_pairing(peer_id, regions, slices)
            theirs = pairing.remote
            kind = _memory_kind(theirs, f"peer {peer_id}")
            peer = _Peer(self._agents.load(peer_id, metadata), pairing, kind)
            try:
                if pairing.slices is None and sum(r.num_blocks for r in theirs) <= self.prepared_rows:
                    rows, peer.offsets = block_table(theirs)
                    with nixl_errors(f"could not prepare peer {peer_id}'s blocks"):
                        peer.dlist = self._agent.prep_xfer_dlist(peer.agent, rows, kind.value)
            except TransferError:
                self._agents.unload(peer.agent)
                raise
            self._peers[peer_id] = peer

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

    def _post(self, peer_id: str, peer: _Peer, selection: Selection) -> _Xfer:
        """Post a checked READ or WRITE: prepared index lists where the peer has them, else its rows."""
        op, sel, lids, rids = selection.op, selection.regions, selection.local_ids, selection.remote_ids
        if selection.blocks == 0:
            return _Xfer(None, None, peer_id, TransferState.DONE)
        what = f"{op} of {selection.blocks} blocks with {peer_id}"
        with nixl_errors(f"could not make a {what}"):
            if peer.dlist is not None:
                handle = self._agent.make_prepped_xfer(op, self._dlist, table_indices(self._offsets, sel, lids),
                                                       peer.dlist, table_indices(peer.offsets, sel, rids), b"")
            else:
                local, remote = peer.pairing.rows(selection)
                if local.shape[0] == 0:  # paired by slices, this peer rank holds none of the selection's bytes
                    return _Xfer(None, None, peer_id, TransferState.DONE)
                handle = self._agent.initialize_xfer(op, self._agent.get_xfer_descs(local, self._kind.value),
                                                     self._agent.get_xfer_descs(remote, peer.kind.value),
                                                     peer.agent, b"")
        try:
            with nixl_errors(f"{what} failed when posted"):
                status = self._agent.transfer(handle)
            if status not in _STATES:
                raise TransferError(f"NIXL {what} failed when posted ({status})")
        except TransferError:
            quietly("releasing a transfer handle", self._agent.release_xfer_handle, handle)
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
            # Every reference goes now, so that the agent and its threads end here and not during interpreter
            # finalization, where NIXL's teardown can abort the process ("terminate called ...").
            self._agent = self._agents = None
        finally:
            self._lock.release()

    # ---- internals (called with the lock held) ----

    def _xfer(self, handle: object) -> _Xfer:
        if not isinstance(handle, _Xfer):
            raise LocalInvalid(f"not a NIXL transfer handle: {handle!r}")
        return handle

    def _refresh(self, xfer: _Xfer) -> None:
        """Ask NIXL where a pending transfer stands; final once NIXL says DONE or fails it."""
        if xfer.handle is None or self._agent is None:
            xfer.state = TransferState.FAILED
            return
        try:
            with nixl_errors(f"transfer with {xfer.peer_id}"):
                status = self._agent.check_xfer_state(xfer.handle)
        except TransferError as exc:
            log.warning("kvconnect nixl: %s", exc)
            status, xfer.kind = "ERR", exc.kind
        state = _STATES.get(status, TransferState.FAILED)
        if state is TransferState.DONE and xfer.cancelled:
            state = TransferState.FAILED
        xfer.state = state

    def _free(self, xfer: _Xfer) -> None:
        """Release a finished transfer's handle and forget it."""
        if xfer.handle is not None and self._agent is not None:
            quietly(f"releasing a transfer with {xfer.peer_id}", self._agent.release_xfer_handle, xfer.handle)
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
                quietly("releasing a peer's prepared list", self._agent.release_dlist_handle, peer.dlist)
            self._agents.unload(peer.agent)
        self._retiring = still
        return bool(still)

    def _undo_register(self) -> None:
        if self._dlist is not None:
            quietly("releasing the local prepared list", self._agent.release_dlist_handle, self._dlist)
            self._dlist = None
        if self._reg is not None:
            quietly("deregistering memory", self._agent.deregister_memory, self._reg)
            self._reg = None
