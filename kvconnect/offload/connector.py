"""OffloadConnector: a host-memory KV tier behind `register_kv_caches`, with prefix lookup and async moves.

Policy and mechanism are apart: `OffloadManager` decides what is stored, loaded and evicted (keys,
slots, pins), `BlockMover` copies bytes, and `JobRunner` runs the copies off the caller's thread.

Typical use by an engine:

    tier = OffloadConnector(cpu_bytes=8 << 30)
    tier.register_kv_caches(kv_caches)
    keys = tier.block_keys(prompt_token_ids)
    hit = tier.lookup(keys)                      # leading blocks in the tier
    job = tier.load(keys[:hit], block_ids[:hit]) # poll() or wait(job) before using those blocks
    ...
    tier.store_request(all_token_ids, block_ids) # when the request finishes; keep its blocks until done

Hybrid models register their KV-cache groups (`groups=[KVGroup(...), ...]`): each group has its own
block table, its own tokens per block and its own keys (salted by group, so a Mamba group's block is
never taken for an attention group's block of the same tokens), and every call names its `group`.
All groups share one slot space: a slot holds one block of the regions of the group that stored it.
In vLLM's hybrid layout every group spans every region (groups share the tensors), so no slot bytes
are wasted; groups over disjoint regions leave the other groups' part of a slot unused.

Lower tiers (`tiers=[DiskTier(...), StoreTier(...)]`, see kvconnect.offload.tiers) sit below the
host pool: every published store is also written down to each of them in the background, `lookup`
counts blocks any tier holds after the host's own, and a load fetches from them (verified page by
page) the blocks the host no longer has. A page no tier can vouch for fails the load, never the bytes.
"""

from __future__ import annotations

import operator
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from kvconnect.descriptors import check_ids
from kvconnect.errors import BlockRangeError, KVConnectError, TransferError
from kvconnect.offload.jobs import JobRunner, OffloadJob
from kvconnect.offload.keys import block_keys, check_keys
from kvconnect.offload.manager import OffloadManager, OffloadStats
from kvconnect.offload.mover import BlockMover
from kvconnect.offload.tiers import PoolView, Tier, leading
from kvconnect.offload.tiers.chain import TierChain
from kvconnect.kvgroups import KVGroup, resolve_groups
from kvconnect.regions import BlockIds, RegionSet


class OffloadConnector:
    """A CPU tier of `cpu_bytes` holding KV blocks by content key, filled and drained asynchronously."""

    def __init__(self, cpu_bytes: int, *, policy: str = "lru", block_size: int = 16, workers: int = 1,
                 timeout_s: float = 60.0, salt: bytes = b"", tiers: Sequence[Tier] = ()):
        try:
            size = -1 if isinstance(cpu_bytes, bool) else operator.index(cpu_bytes)  # ints, numpy ints
        except TypeError:
            size = -1
        if size <= 0:
            raise KVConnectError(f"cpu_bytes must be a positive int, got {cpu_bytes!r}")
        cpu_bytes = size
        if block_size <= 0:
            raise KVConnectError(f"block_size must be positive, got {block_size}")
        if timeout_s <= 0:
            raise KVConnectError(f"timeout_s must be positive, got {timeout_s}")
        if workers <= 0:
            raise KVConnectError(f"workers must be positive, got {workers}")
        if not all(isinstance(t, Tier) for t in tiers):
            raise KVConnectError("tiers must be Tier instances (kvconnect.offload.tiers)")
        self._tiers = list(tiers)
        self._chain: TierChain | None = None
        self.cpu_bytes = cpu_bytes
        self.policy = policy
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.salt = salt
        self._workers = workers
        self._regions: RegionSet | None = None
        self._groups: list[KVGroup] = []
        self._group_regions: list[np.ndarray] = []
        self._manager: OffloadManager | None = None
        self._mover: BlockMover | None = None
        self._runner: JobRunner | None = None
        self._closed = False

    # ---- setup ----

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                           groups: Sequence[KVGroup] | None = None) -> RegionSet:
        """Register the engine's KV tensors (and KV-cache groups) and allocate as many slots as `cpu_bytes` holds."""
        if self._regions is not None:
            raise KVConnectError("register_kv_caches was already called on this connector")
        if groups is not None and (not groups or not all(isinstance(g, KVGroup) for g in groups)):
            raise KVConnectError("groups must be a non-empty list of KVGroup")
        regions = RegionSet.from_kv_caches(kv_caches, None if groups is None else [g.layers for g in groups])
        self._group_regions = [np.asarray(sel, dtype=np.int64) for sel in resolve_groups(regions, groups)]
        self._groups = list(groups) if groups is not None else [KVGroup(layers=tuple(regions.names))]
        slot_bytes = sum(r.block_bytes for r in regions)
        num_slots = self.cpu_bytes // slot_bytes
        if num_slots == 0:
            raise KVConnectError(
                f"cpu_bytes={self.cpu_bytes} cannot hold one block of every layer ({slot_bytes} bytes)"
            )
        manager = OffloadManager(num_slots, self.policy, slot_bytes)
        mover = BlockMover(kv_caches, regions, num_slots)
        if self._tiers:
            view = PoolView(tuple(p.view(torch.uint8).numpy() for p in mover.pool), mover.quarantine)
            self._chain = TierChain(self._tiers, view)
        self._runner = JobRunner(self._workers)
        self._regions, self._manager, self._mover = regions, manager, mover
        return regions

    def _ready(self) -> tuple[RegionSet, OffloadManager, BlockMover, JobRunner]:
        if self._closed:
            raise KVConnectError("the offload connector is closed")
        if self._regions is None:
            raise KVConnectError("call register_kv_caches before using the offload tier")
        return self._regions, self._manager, self._mover, self._runner

    @property
    def regions(self) -> RegionSet:
        """The registered regions."""
        return self._ready()[0]

    @property
    def num_slots(self) -> int:
        """Blocks the tier holds at most."""
        return self._ready()[1].num_slots

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one block: one page of every registered layer."""
        return self._ready()[2].slot_bytes

    @property
    def groups(self) -> list[KVGroup]:
        """The registered KV-cache groups (one of every layer unless groups were given)."""
        self._ready()
        return list(self._groups)

    def _group(self, group: int) -> tuple[np.ndarray, int]:
        """(region indices, bytes of one block) of group `group`."""
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self._groups):
            raise KVConnectError(f"group must be an index in [0, {len(self._groups)}), got {group!r}")
        sel = self._group_regions[group]
        return sel, sum(self._regions[int(k)].block_bytes for k in sel)

    @property
    def manager(self) -> OffloadManager:
        """The scheduler-side state (keys, slots, policy)."""
        return self._ready()[1]

    # ---- keys and lookup ----

    def block_keys(self, token_ids: Sequence[int] | np.ndarray, parent: bytes | None = None,
                   group: int = 0) -> list[bytes]:
        """Chained content keys of the full blocks of `token_ids` in `group` (see kvconnect.offload.keys)."""
        self._ready()
        self._group(group)
        block_size = self._groups[group].block_size or self.block_size
        # One group keeps the plain salt (keys as without groups); several are kept apart by index and kind.
        salt = self.salt if len(self._groups) == 1 else self.salt + f"\0group{group}:{self._groups[group].label}".encode()
        return block_keys(token_ids, block_size, parent=parent, salt=salt)

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many leading blocks of `keys` the host pool, then the lower tiers, hold; unknown keys are misses."""
        keys = self._tier_keys(check_keys(keys))
        hits = self._ready()[1].lookup(keys)
        if self._chain is None or hits == len(keys):
            return hits
        below = self._chain.contains(keys[hits:])
        return hits + leading(below)

    def _tier_keys(self, keys: list[Hashable]) -> list[Hashable]:
        if self._chain is not None and not all(isinstance(k, bytes) for k in keys):
            raise KVConnectError("with lower tiers, keys must be bytes (block_keys makes them)")
        return keys

    # ---- moves ----

    def store(self, keys: Sequence[Hashable], block_ids: BlockIds, group: int = 0) -> OffloadJob:
        """Copy block `block_ids[i]` of `group` into the tier under `keys[i]`, asynchronously; keep the blocks until done.

        Keys already held are skipped; when the tier is full of blocks in flight, the tail that finds
        no room is dropped (`stats().dropped`). Stored blocks become visible to `lookup` only when the
        job succeeded; a failed job publishes none of them.
        """
        _, manager, mover, runner = self._ready()
        sel, nbytes, keys, ids = self._checked(keys, block_ids, group)
        self._tier_keys(keys)
        after = mover.engine_event()
        plan = manager.prepare_store(keys)
        src = ids[plan.positions]
        chain = self._chain

        def finish(err: BaseException | None) -> None:
            down = chain is not None and err is None and len(plan) > 0
            manager.complete_store(plan, err is None, nbytes, pin=down)
            if down:
                queued = chain.write_behind(plan.keys, plan.slots, manager.unpin)
                manager.unpin(plan.keys[queued:])

        job = OffloadJob("store", plan.keys, src, len(plan) * nbytes,
                         lambda: mover.store(src, plan.slots, after, self.timeout_s, regions=sel), finish)
        return self._submit(runner, job, empty=len(plan) == 0)

    def store_request(self, token_ids: Sequence[int] | np.ndarray, block_ids: BlockIds,
                      parent: bytes | None = None, group: int = 0) -> OffloadJob:
        """Store the full blocks of a finished request in `group`: keys from its tokens, its leading block ids."""
        keys = self.block_keys(token_ids, parent, group)
        ids = check_ids(self._ready()[0], block_ids, self._group(group)[0])
        if ids.size < len(keys):
            raise BlockRangeError(f"{len(keys)} full blocks of tokens but only {ids.size} block ids")
        return self.store(keys, ids[: len(keys)], group)

    def load(self, keys: Sequence[Hashable], block_ids: BlockIds, group: int = 0) -> OffloadJob:
        """Copy the tier's blocks of `keys` into blocks `block_ids` of `group`, asynchronously; every key must be held."""
        return self._load(keys, block_ids, group, prefix=False)

    def load_prefix(self, keys: Sequence[Hashable], block_ids: BlockIds, group: int = 0) -> OffloadJob:
        """Lookup and load at once: the leading held blocks of `keys` into the leading `block_ids`.

        Safe against concurrent stores evicting between a separate `lookup` and `load`; the job's
        `num_blocks` is the number of hits (counted in the lookup stats).
        """
        return self._load(keys, block_ids, group, prefix=True)

    def _load(self, keys: Sequence[Hashable], block_ids: BlockIds, group: int, prefix: bool) -> OffloadJob:
        _, manager, mover, runner = self._ready()
        sel, nbytes, keys, ids = self._checked(keys, block_ids, group)
        if np.unique(ids).size != ids.size:
            values, counts = np.unique(ids, return_counts=True)
            raise BlockRangeError(f"block id {int(values[np.argmax(counts > 1)])} appears twice in one load")
        after = mover.engine_event()
        if self._chain is not None:
            return self._load_through_tiers(keys, ids, sel, nbytes, after, prefix)
        plan = manager.prepare_load_prefix(keys) if prefix else manager.prepare_load(keys)
        ids = ids[: len(plan)]
        job = OffloadJob("load", plan.keys, ids, len(plan) * nbytes,
                         lambda: mover.load(plan.slots, ids, after, self.timeout_s, regions=sel),
                         lambda err: manager.complete_load(plan, err is None, nbytes))
        return self._submit(runner, job, empty=len(plan) == 0)

    def _load_through_tiers(self, keys: list[bytes], ids: np.ndarray, sel: np.ndarray, nbytes: int,
                            after, prefix: bool) -> OffloadJob:
        """A load whose blocks the host pool lacks come up from the lower tiers first, in the same job."""
        _, manager, mover, runner = self._ready()
        chain = self._chain
        keys = self._tier_keys(keys)
        if prefix:
            # The host's leading hits pinned first (no store can evict them now), then the blocks
            # after them that a lower tier holds, as far as the pool has room for them.
            plan = manager.prepare_load_prefix(keys)
            below = chain.contains(keys[len(plan):])
            wanted = keys[len(plan): len(plan) + leading(below)]
            up = manager.prepare_store(wanted, leading=True)
            slots = np.concatenate([plan.slots, up.slots])
        else:
            host = manager.published(keys)
            at_host, at_below = np.flatnonzero(host), np.flatnonzero(~host)
            below = chain.contains([keys[i] for i in at_below])
            if not below.all():
                pos = int(at_below[leading(below)])
                raise KVConnectError(f"key at position {pos} is in no offload tier; load only what lookup() reported")
            plan = manager.prepare_load([keys[i] for i in at_host])
            up = manager.prepare_store([keys[i] for i in at_below], leading=True)
            if len(up) < at_below.size:
                manager.complete_store(up, False, promoted=True)
                manager.complete_load(plan, False)
                raise KVConnectError(f"no room in the host pool to bring {at_below.size} blocks up from the lower tiers")
            slots = np.empty(len(keys), dtype=np.int64)
            slots[at_host], slots[at_below] = plan.slots, up.slots
        cut = slots.size
        ids = ids[:cut]
        fetched: list[bool] = []

        def work() -> None:
            if len(up):
                got = chain.fetch(up.keys, up.slots)
                fetched.append(bool(got.all()))
                if not got.all():
                    raise TransferError(f"{int((~got).sum())} of {len(up)} blocks could not be read from the lower "
                                        "tiers (missing, or failed their checksums)")
            mover.load(slots, ids, after, self.timeout_s, regions=sel)

        def finish(err: BaseException | None) -> None:
            manager.complete_store(up, bool(fetched and fetched[0]), nbytes, promoted=True)
            manager.complete_load(plan, err is None, nbytes)

        job = OffloadJob("load", tuple(keys[:cut]), ids, cut * nbytes, work, finish)
        return self._submit(runner, job, empty=cut == 0)

    def _checked(self, keys: Sequence[Hashable], block_ids: BlockIds,
                 group: int) -> tuple[np.ndarray, int, list[Hashable], np.ndarray]:
        """(group's regions, its bytes per block, keys, block ids), checked against each other and the regions."""
        sel, nbytes = self._group(group)
        keys = check_keys(keys)
        ids = check_ids(self._regions, block_ids, sel)
        if ids.size != len(keys):
            raise BlockRangeError(f"{len(keys)} keys but {ids.size} block ids")
        return sel, nbytes, keys, ids

    def _submit(self, runner: JobRunner, job: OffloadJob, empty: bool) -> OffloadJob:
        if empty:
            job._work = None  # nothing to copy: complete now, on the caller's thread
            return runner.finish_now(job)
        try:
            return runner.submit(job)
        except BaseException:
            job._cancel("could not be queued")
            raise

    # ---- completion ----

    def poll(self) -> list[OffloadJob]:
        """Jobs that ended (successfully or not) since the previous poll."""
        return self._ready()[3].poll()

    def wait(self, job: OffloadJob, timeout: float | None = None) -> OffloadJob:
        """Wait for `job` (default timeout `timeout_s`); TransferError if it failed or is still running."""
        timeout = self.timeout_s if timeout is None else timeout
        if not job.wait(timeout):
            raise TransferError(f"{job.kind} job {job.id} did not complete within {timeout} s")
        if job.error is not None:
            raise TransferError(f"{job.kind} job {job.id} failed: {job.error}") from job.error
        return job

    def stats(self) -> OffloadStats:
        """Hits, misses, stores, loads, evictions and bytes moved so far."""
        return self._ready()[1].stats()

    def tier_stats(self) -> dict[str, int]:
        """The lower tiers' counters (`tier_<name>_<counter>`), empty without tiers."""
        self._ready()
        return {} if self._chain is None else self._chain.stats()

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Wait until every stored block went down to the lower tiers; False if still copying at `timeout`."""
        self._ready()
        return True if self._chain is None else self._chain.flush(self.timeout_s if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish queued jobs and stop the workers (bounded by `timeout`, default `timeout_s`)."""
        if self._closed:
            return
        if self._runner is not None:
            # Raises while a copy is stuck: the connector stays open, so a later close() can finish.
            self._runner.close(self.timeout_s if timeout is None else timeout)
        if self._chain is not None:
            self._chain.close(self.timeout_s if timeout is None else timeout)
        self._closed = True
        self._mover = None  # the host pool goes with it

    def __enter__(self) -> OffloadConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
