"""The cluster tier: Mooncake Store, shared by every instance that names the same master.

One `MooncakeDistributedStore` client per instance, contributing no memory of its own (segment 0):
the store's memory is given by storage nodes (`mooncake_client`, or instances started with a
segment). An object is a page's rows, region by region, then a 16-byte trailer (magic and the
page's checksum over its key and bytes). A put of pages with short rows gathers each into one
registered buffer with its trailer (`store_put`: one transfer per object, not one per row); longer
rows are put in place from the pool's slots (they and an array of trailers are registered with the
client). A get is bounded by `get_timeout_s` (`store_staging`): short rows land in a registered
staging area and are copied into their slots once checked, long rows land in their slots (an
abandoned call's slots held in the pool's quarantine until it returns), each part checked while the
next arrives; an object that fails its checks is removed from the store and denied here until that
succeeds (`store_denylist`), so no instance counts it again.

The master's health decides what happens, never the engine's step: down at start, the tier warns
once and stays off while a background thread tries again every `retry_s`; killed mid-run, gets and
puts fail within the client's own timeout (about 4 s here), each a counted miss or dropped store;
stalled (or a storage node stalled), Mooncake waits 30 s, so a get is abandoned at `get_timeout_s`
with its pages missed, and lookups answer none for `retry_s`; back again, the client reconnects.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Sequence

import numpy as np

from kvconnect.errors import KVConnectError
from kvconnect.offload.tiers import overlap
from kvconnect.offload.tiers.base import PoolView, Tier
from kvconnect.offload.tiers.calls import InFlight
from kvconnect.offload.tiers.integrity import namespace_of, slot_checksums
from kvconnect.offload.tiers.store_denylist import FORGET_WAIT_S, MAX_DENIED, DenyList
from kvconnect.offload.tiers.store_put import PutStaging, gathers
from kvconnect.offload.tiers.store_staging import (GET_STAGING_BYTES, NOT_FOUND, TOO_LARGE, TRAILER_BYTES,
                                                   TRAILER_MAGIC, StagingArea, object_buffers)
from kvconnect.threads import spawn, unpinned

log = logging.getLogger("kvconnect.offload.store")

# One call moves at most this many pages and bytes of pages (their trailers besides): Mooncake's batch
# calls hold every buffer of the batch at once.
MAX_BATCH_KEYS = 128
MAX_BATCH_BYTES = 64 << 20
SLOW_LOOKUP_S = 0.5
CLOSE_WAIT_S = 5.0
LATE_CLOSE_WAIT_S = 120.0  # past Mooncake's own 30 s per stalled call, with room
_LEFT_OPEN: list = []  # clients closed while a call was in flight: never freed under it
_clients_set_up = [0]  # Mooncake clients this process set up: each costs memory the library keeps


def _close_when_idle(client: object, calls: InFlight) -> None:
    """Close a client left open at close() once its calls returned (Mooncake's own deadline bounds them),
    so that its buffers are not kept for the life of the process."""
    if calls.wait_idle(LATE_CLOSE_WAIT_S) == 0:
        _LEFT_OPEN.remove(client)
        client.close()
    else:
        log.warning("store tier: Mooncake calls still in flight %.0f s after close; the client stays open",
                    LATE_CLOSE_WAIT_S)


def clients_set_up() -> int:
    """How many Mooncake Store clients this process has set up (a reconnect sets up a new one).

    Measured with Mooncake 0.3.x here: every client set up and closed keeps about 6 MiB of the
    process's memory (with kvconnect's code of earlier releases too), so a long run that reconnects
    often grows by that much per reconnect.
    """
    return _clients_set_up[0]
# Names kept importable from here: the object format, Mooncake's codes, the staging and deny-list bounds.
__all__ = ["FORGET_WAIT_S", "GET_STAGING_BYTES", "MAX_BATCH_BYTES", "MAX_BATCH_KEYS", "MAX_DENIED", "NOT_FOUND",
           "TOO_LARGE", "TRAILER_BYTES", "TRAILER_MAGIC", "StoreTier"]


class StoreTier(Tier):
    """Pages as Mooncake Store objects named `kvc/<namespace>/<key>`."""

    name = "store"

    def __init__(self, master: str, *, protocol: str = "tcp", local_host: str = "127.0.0.1",
                 metadata_server: str = "P2PHANDSHAKE", device: str = "", namespace: bytes = b"",
                 retry_s: float = 10.0, local_buffer_bytes: int = 16 << 20, get_timeout_s: float = 5.0):
        super().__init__()
        if not get_timeout_s > 0:
            raise KVConnectError(f"store tier get_timeout_s must be positive, got {get_timeout_s!r}")
        if not isinstance(master, str) or ":" not in master:
            raise KVConnectError(f"store tier master must be 'host:port', got {master!r}")
        if protocol not in ("tcp", "rdma"):
            raise KVConnectError(f"store tier protocol must be 'tcp' or 'rdma', got {protocol!r}")
        self.master = master
        self.protocol = protocol
        self.local_host = local_host
        self.metadata_server = metadata_server
        self.device = device
        self.namespace = namespace
        self.retry_s = retry_s
        self.local_buffer_bytes = local_buffer_bytes
        self.get_timeout_s = get_timeout_s
        self._pool: PoolView | None = None
        self._trailers: np.ndarray | None = None
        self._staging: StagingArea | None = None
        self._gather: PutStaging | None = None
        self._client = None
        self._prefix = ""
        self._up = threading.Event()
        self._closed = threading.Event()
        self._warned_down = False
        self._lookups_off_until = 0.0
        self._lookup_busy = False
        self._lock = threading.Lock()
        self._calls = InFlight()  # Mooncake calls on threads of their own (lookups, bounded gets, removals)
        self._corrupt = DenyList(self._calls, self._connected)

    # ---- connection ----

    def attach(self, pool: PoolView) -> None:
        """Bind to the pool and connect; a master that is down leaves the tier off, retried in the background."""
        self._pool = pool
        self._trailers = np.zeros((pool.num_slots, 2), dtype="<u8")  # magic, checksum: 16 bytes a slot
        self._gather = PutStaging(pool, MAX_BATCH_KEYS) if gathers(pool) else None
        self._staging = StagingArea(pool, MAX_BATCH_KEYS, self._calls, self._abandoned, direct=self._gather is None)
        self._connect(pool.page_bytes)

    def open_for_lookups(self, page_bytes: int) -> None:
        """Connect for `contains` only, registering no memory (a scheduler that decides what to load)."""
        self._connect(page_bytes)

    def _connect(self, page_bytes: int) -> None:
        self._prefix = f"kvc/{namespace_of(self.namespace, page_bytes).hex()}/"
        if not self._try_connect():
            spawn(self._reconnect, name="kvconnect-store-connect")

    @property
    def available(self) -> bool:
        """Whether the tier has a working client (it may still fail calls while the master is down)."""
        return self._client is not None

    def wait_available(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a client (tests, tools); the tier itself never waits for one."""
        return self._up.wait(timeout)

    def _reconnect(self) -> None:
        while not self._closed.wait(self.retry_s):
            if self._try_connect():
                log.warning("store tier: connected to Mooncake master %s", self.master)
                return

    def _master_listens(self) -> bool:
        # The client's own setup retries an absent master for about 90 s; a plain connect answers at once.
        host, _, port = self.master.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                return True
        except (OSError, ValueError):
            return False

    def _try_connect(self) -> bool:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise KVConnectError("the store tier needs the mooncake package (pip install kvconnect[mooncake])") from exc
        rc = "no answer on its port"
        if self._master_listens():
            client = MooncakeDistributedStore()
            # The client's threads inherit the caller's CPUs: an engine's pinned core would starve them.
            code = unpinned(lambda: client.setup(self.local_host, self.metadata_server, 0, self.local_buffer_bytes,
                                                 self.protocol, self.device, self.master))
            if code == 0:
                _clients_set_up[0] += 1
                gathered = () if self._gather is None else (self._gather.rows,)
                for arr in () if self._pool is None else (*self._pool.rows, self._trailers, self._staging.rows, *gathered):
                    span = arr.strides[0] * arr.shape[0]  # staging rows are padded to pages
                    if client.register_buffer(arr.ctypes.data, span) != 0:
                        client.close()
                        raise KVConnectError(f"store tier: registering {span} bytes of host pool failed")
                with self._lock:
                    if self._closed.is_set():
                        client.close()
                        return True
                    self._client = client
                self._up.set()
                return True
            rc = f"setup returned {code}"
        if not self._warned_down:
            self._warned_down = True
            log.warning("store tier: Mooncake master %s unreachable (%s); the tier is off and tried again every "
                        "%.0f s", self.master, rc, self.retry_s)
        return False

    def _connected(self):
        """The client, or None while the store has not been reached."""
        return self._client

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self._prefix + k.hex() for k in keys]

    def _batches(self, n: int) -> list[slice]:
        # The bound counts the pages' bytes, not their 16-byte trailers: counted in, they would cut a
        # batch of 2 MiB pages to 31 and cost a third call for 64 pages, where Mooncake's own moves two.
        per = max(1, min(MAX_BATCH_KEYS, MAX_BATCH_BYTES // self._pool.page_bytes))
        return [slice(i, min(n, i + per)) for i in range(0, n, per)]

    # ---- moves ----

    def _seal(self, names: list[str], slots: np.ndarray) -> None:
        """Write the trailers (magic, checksum over name and page) of the pages of `slots`."""
        self._trailers[slots, 0] = TRAILER_MAGIC
        self._trailers[slots, 1] = slot_checksums([n.encode() for n in names], self._pool, slots)

    def _put_batched(self, names: list[str], slots: np.ndarray) -> np.ndarray:
        """One multi-buffer batch put per batch, straight from the pool's slots: status per object.

        Each batch's trailers are computed on the helper thread while the batch before it is put
        (Mooncake's call releases the GIL), so only the first batch's checksums delay the puts. A
        put's slots are distinct, so the helper never writes a trailer that the running call reads.
        """
        out = np.zeros(len(names), dtype=np.int64)
        parts = self._batches(len(names))
        self._seal(names[parts[0]], slots[parts[0]])
        for i, part in enumerate(parts):
            sealing = None
            if i + 1 < len(parts):
                sealing = overlap.later(lambda p=parts[i + 1]: self._seal(names[p], slots[p]))
            try:
                trailers = self._trailers.ctypes.data + slots[part].astype(np.uint64) * TRAILER_BYTES
                out[part] = self._client.batch_put_from_multi_buffers(
                    names[part], *object_buffers(self._pool, slots[part], trailers))
            finally:
                if sealing is not None:
                    overlap.result(sealing)  # never left writing trailers after the put returned
        return out

    def put(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        """Store the pages of `slots` with their trailers; an object the store already holds counts as stored."""
        if self._connected() is None or not keys:
            self._count("store_failed", len(keys))
            return np.zeros(len(keys), dtype=bool)
        slots = np.asarray(slots, dtype=np.int64)
        names = self._names(keys)
        if self._gather is not None:  # short rows: one buffer per object (store_put)
            ok = self._gather.put(self._client, names, slots) == 0
        else:
            ok = self._put_batched(names, slots) == 0
        stored = int(ok.sum())
        self._count("stored", stored, stored * self._pool.page_bytes)
        if stored < len(keys):
            self._count("store_failed", len(keys) - stored)
            log.warning("store tier: %d of %d pages not stored (master %s)", len(keys) - stored, len(keys), self.master)
        return ok

    def get(self, keys: Sequence[bytes], slots: np.ndarray) -> np.ndarray:
        """Read objects into `slots` within `get_timeout_s`; a missing, short, long or corrupt object is False."""
        ok = np.zeros(len(keys), dtype=bool)
        client = self._connected()
        if client is None or not keys or self._staging.stuck:
            self._count("missed", len(keys))
            return ok
        slots = np.asarray(slots, dtype=np.int64)
        names = self._names(keys)
        denied = self._corrupt.denied(names)
        if denied.any():  # known corrupt: not read again, and its removal tried again
            self._corrupt.forget([names[i] for i in np.flatnonzero(denied)])
        deadline = time.monotonic() + self.get_timeout_s
        todo = np.flatnonzero(~denied)
        got = np.full(len(keys), NOT_FOUND, dtype=np.int64)
        if todo.size:
            got[todo], ok[todo] = self._staging.get_many(client, [names[i] for i in todo], slots[todo], deadline)
        bad = np.flatnonzero(~ok & ((got >= 0) | (got == TOO_LARGE)))
        self._count("missed", len(keys) - int(ok.sum()) - bad.size)
        self._count("loaded", int(ok.sum()), int(ok.sum()) * self._pool.page_bytes)
        if bad.size:
            self._count("rejected", bad.size)
            self._corrupt.warn([names[i] for i in bad], got[bad], self._pool.page_bytes + TRAILER_BYTES)
            self._corrupt.forget([names[i] for i in bad])
        return ok

    def _abandoned(self, n: int) -> None:
        """A get of `n` objects outlived `get_timeout_s`: the store is stalled, so lookups rest too."""
        self._lookups_off_until = time.monotonic() + self.retry_s
        log.warning("store tier: a get of %d objects at master %s took over %.1f s; they are misses, and "
                    "lookups answer none for %.0f s", n, self.master, self.get_timeout_s, self.retry_s)

    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        """True per object the master lists (an unreachable or stalled master lists none).

        Lookups run on an engine's scheduling path, and a stalled master holds Mooncake's RPC for its
        whole timeout (30 s here). So the RPC runs on its own thread and is waited for SLOW_LOOKUP_S
        at most; after a failed or late one, lookups answer "none" at once for `retry_s`, and never
        more than one RPC is outstanding.
        """
        client = self._connected()
        if client is None or not keys or time.monotonic() < self._lookups_off_until:
            return np.zeros(len(keys), dtype=bool)
        with self._lock:
            if self._lookup_busy:
                return np.zeros(len(keys), dtype=bool)
            self._lookup_busy = True
        names = self._names(keys)
        box: dict[str, list[int]] = {}
        done = threading.Event()

        def ask() -> None:
            try:
                box["got"] = client.batch_is_exist(names)
            finally:
                with self._lock:
                    self._lookup_busy = False
                done.set()

        self._calls.start(ask, "kvconnect-store-lookup")
        got = np.asarray(box["got"]) if done.wait(SLOW_LOOKUP_S) and "got" in box else None
        if got is None or (got < 0).any():
            self._lookups_off_until = time.monotonic() + self.retry_s
            log.warning("store tier: a lookup at master %s failed or took over %.1f s; answering none for %.0f s",
                        self.master, SLOW_LOOKUP_S, self.retry_s)
            return np.zeros(len(keys), dtype=bool)
        return (got == 1) & ~self._corrupt.denied(names)

    def close(self) -> None:
        """Close the client (the objects stay in the store for other instances).

        Closing a Mooncake client under a call in flight crashes the process, so a call abandoned at
        its deadline is waited for up to CLOSE_WAIT_S; one still running then leaves the client open
        (its buffers stay referenced by the call), logged.
        """
        with self._lock:
            client, self._client = self._client, None
            self._closed.set()
        busy = self._calls.wait_idle(CLOSE_WAIT_S)
        if client is not None:
            if busy:
                log.warning("store tier: %d Mooncake calls still in flight at close; the client is closed once "
                            "they return", busy)
                _LEFT_OPEN.append(client)
                spawn(_close_when_idle, name="kvconnect-store-close", args=(client, self._calls))
            else:
                client.close()
