"""The scheduler-side half of KVConnectOffload: which blocks to load from the tier and which to store.

The scheduler owns the tier's bookkeeping (an `OffloadManager`: keys, slots, eviction, pins); the
worker owns the bytes. A prefix hit pins its slots until the step that loads them has run; a finished
request's new blocks get slots and are copied by the worker after that step's forward pass.

With lower tiers (`tiers` in the extra config), a hit may continue below the host pool: those blocks
get host slots, and the request waits (an asynchronous load) while the worker brings them up and
copies them in; what cannot come up is reported as a load error and recomputed. Stored blocks stay
pinned after they are published until the worker reports them written down.

With tensor parallelism this one scheduler decides for every rank: each rank's worker runs the same
orders on its own host pool (the same slots, each holding that rank's shard of the block), so a key
the manager holds is held by every rank. Below the host pool each rank writes its shard under its own
keys; the lower index counts a block only when every rank's page is there, and a stored block's
slots stay pinned until every rank reported it done with them (written down, or its store failed;
`offload_reports` counts the ranks).

With several KV-cache groups (sliding-window and full-attention layers) each slot holds one group's
block under a key of that group (`offload_groups`), in the host pool and below it alike: a hit needs
the full-attention groups' blocks and the sliding-window groups' windows, from wherever they are.

A group that keeps one state for the whole sequence (short conv, GDN, in vLLM's `align` mode) is
stored from vLLM's offers (`offload_states`, each the block holding the state after a block
boundary): the block is copied after the forward pass of the step that offered it, under the
key of that token block, and published once every rank copied it; its running block is never stored
(it is no boundary state). A hit needs the state at its last block, which vLLM loads into the one
block it allocates there; such loads are always asynchronous, since vLLM copies that block into the
running one before a step's forward pass, and a load that cannot be made fails its request.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kvconnect import metrics
from kvconnect.integrations.vllm.config import OffloadConfig
from kvconnect.integrations.vllm import dump
from kvconnect.integrations.vllm.groups import GroupRule
from kvconnect.integrations.vllm.meta import KVConnectMeta, KVConnectWorkerMeta, OffloadLoad, OffloadStore
from kvconnect.integrations.vllm.offload_reports import RankReports
from kvconnect.integrations.vllm.stats import StatsFile
from kvconnect.integrations.vllm.offload_groups import group_blocks, hit_blocks, state_block_ok, stored_blocks
from kvconnect.integrations.vllm.offload_states import offered_states
from kvconnect.integrations.vllm.tiers import lower_index
from kvconnect.offload.keys import block_keys, group_keys
from kvconnect.offload.manager import LoadPlan, OffloadManager, StorePlan
from kvconnect.offload.recompute import ComputeRate
from kvconnect.offload.tiers import leading

# What the workers report about each load (TP rank 0's measure): seconds it took, and against
# recomputing its tokens at the engine's rate, the estimated compute time and what was saved.
_LOAD_KEYS = ("load_seconds", "load_recompute_seconds_est", "load_saved_seconds_est")

if TYPE_CHECKING:
    from prometheus_client import Counter
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _count_groups(counter: Counter, group_ids: Sequence[int], per_group: Sequence[int]) -> None:
    """Add each group's blocks to a per-group counter, labelled with vLLM's index of the group."""
    # In the scheduler's process; its connector stats carry the increments to vLLM's /metrics (`prom`).
    for group, n in zip(group_ids, per_group):
        if n:
            counter.labels(str(group)).inc(int(n))


class OffloadScheduler:
    """Prefix lookups, load plans and store plans for one engine's host tier."""

    def __init__(self, config: OffloadConfig, *, block_size: int, num_slots: int, slot_bytes: int,
                 namespace: bytes = b"", shards: Sequence[bytes] = (b"",), rules: Sequence[GroupRule] = (),
                 group_ids: Sequence[int] = (0,)):
        self.block_size = block_size
        # Several groups: vLLM's index of each group this tier keeps, and which of its blocks a hit needs.
        self.rules, self.group_ids = tuple(rules), tuple(group_ids)
        self._state = tuple(r.whole_sequence_state for r in self.rules)  # per group: a whole-sequence state
        self._grouped = len(self.group_ids) > 1 or any(self._state)  # keys, hits and blocks per group
        self._stats_group = next((g for g, r in enumerate(self.rules)
                                  if not r.window_tokens and not r.whole_sequence_state), 0)
        self._group_hits = np.zeros(len(self.group_ids), dtype=np.int64)  # group blocks promised to vLLM
        self._group_tier_hits = np.zeros(len(self.group_ids), dtype=np.int64)  # of those, brought up from below
        self.salt = config.salt.encode()
        self.manager = OffloadManager(num_slots, config.policy, slot_bytes)
        self._keys: dict[str, tuple[int, list[list[bytes]]]] = {}  # request -> (tokens, keys per group)
        self._requests: dict[str, Request] = {}  # state groups: the live requests whose offers are keyed
        self._state_counts = {"state_stores": 0, "state_hits": 0, "state_refused": 0}
        self._computed: dict[str, int] = {}
        self._meta = KVConnectMeta()
        self._pending_loads: list[LoadPlan] = []
        self._load_batches: list[list[LoadPlan]] = []  # load plans per built step, unpinned when it reported
        self._stores: dict[str, StorePlan] = {}
        self._stats_file = StatsFile(config.stats_path)
        self.lower = lower_index(config.tiers, namespace, slot_bytes, shards) if config.tiers else None
        self.tp = len(shards)
        # Keys travel to the workers when they write pages down, or dump them for a test's byte check.
        self._keyed = self.lower is not None or bool(os.environ.get(dump.ENV))
        self._reports = RankReports(self.tp)  # which ranks copied or wrote down each store
        self._abandoned: dict[str, StorePlan] = {}  # failed stores whose slots a rank may still read
        self._matched: dict[str, tuple[int, int]] = {}  # request -> (host hits, hits below), last asked
        # Several groups: request -> group keys its hit brings up (none: the load is synchronous).
        self._below: dict[str, set[bytes]] = {}
        self._promotions: dict[str, tuple[LoadPlan, StorePlan]] = {}
        self._writing: dict[str, tuple[bytes, ...]] = {}  # request -> keys pinned until written down
        self._tier = {"tier_hits": 0, "promoted": 0, "promote_failed": 0, "written_down": 0}
        self.rate = ComputeRate()
        # What the workers credited their loads with, summed, and the rate they were last credited at.
        self._loads = {**dict.fromkeys(_LOAD_KEYS, 0.0), "seconds_per_token_est": 0.0}

    def _keys_of(self, request: Request) -> list[list[bytes]]:
        """The prompt's block keys per group (group 0's are the token blocks' own)."""
        tokens = request.prompt_token_ids or []
        got = self._keys.get(request.request_id)
        if got is None or got[0] != len(tokens):
            got = (len(tokens), group_keys(block_keys(tokens, self.block_size, salt=self.salt), len(self.group_ids)))
            self._keys[request.request_id] = got
        return got[1]

    def track(self, request: Request) -> None:
        """A new request: with state groups, kept until it finishes, to key the states vLLM offers."""
        if any(self._state):
            self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Leading prompt blocks the tier holds beyond what vLLM computed (the last prompt token never)."""
        n_prompt = len(request.prompt_token_ids or ())
        if n_prompt < 2 or num_computed_tokens % self.block_size:
            return 0, False
        grouped = self._keys_of(request)
        keys = grouped[0]
        limit = min(len(keys), (n_prompt - 1) // self.block_size)
        start = num_computed_tokens // self.block_size
        if self._grouped:
            self._computed[request.request_id] = num_computed_tokens
            return self._group_match(request.request_id, grouped, start, limit)
        hits = 0
        while start + hits < limit and self.manager.contains(keys[start + hits]):
            hits += 1
        below = 0
        if self.lower is not None and start + hits < limit:
            # A block already on its way into the host pool (another request's promotion or store) can
            # get no second slot: the hit from below stops before it, and this request computes the rest.
            end = start + hits
            while end < limit and self.manager.absent(keys[end]):
                end += 1
            below = leading(self.lower.contains(keys[start + hits:end]))
        self._computed[request.request_id] = num_computed_tokens
        self._matched[request.request_id] = (hits, below)
        return (hits + below) * self.block_size, below > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Pin the hit's slots and tell the worker to load them into the allocated blocks."""
        if num_external_tokens <= 0:
            return
        grouped = self._keys_of(request)
        start = self._computed.get(request.request_id, 0) // self.block_size
        nblk = num_external_tokens // self.block_size
        if self._grouped:
            self._group_alloc(request.request_id, grouped, blocks.get_block_ids(), start, nblk)
            return
        keys = grouped[0]
        ids = [int(i) for i in blocks.get_block_ids()[0][start:start + nblk]]
        self.manager.lookup(keys)  # counted once per admitted request, for the hit/miss stats
        hits = min(nblk, self._matched.get(request.request_id, (nblk, 0))[0])
        plan = self.manager.prepare_load(keys[start:start + hits])
        if hits == nblk:
            self._meta.offload_loads.append(OffloadLoad(block_ids=ids, slots=plan.slots.tolist(),
                                                        keys=list(plan.keys) if self._keyed else [],
                                                        tokens=num_external_tokens))
            self._pending_loads.append(plan)
            return
        up = self.manager.prepare_store(keys[start + hits:start + nblk], leading=True)
        got = hits + len(up)
        self._tier["tier_hits"] += nblk - hits
        self._meta.offload_loads.append(OffloadLoad(
            block_ids=ids[:got], slots=plan.slots.tolist() + up.slots.tolist(), request_id=request.request_id,
            fetch_keys=list(up.keys), fetch_from=hits, invalid_block_ids=ids[got:], tokens=num_external_tokens))
        self._promotions[request.request_id] = (plan, up)

    def _group_match(self, rid: str, grouped: list[list[bytes]], start: int, limit: int) -> tuple[int, bool]:
        """Several groups: the longest hit whose every needed group block is in the host pool or below it."""
        n = max(limit - start, 0)
        host = [np.fromiter((self.manager.contains(k) for k in ks[start:limit]), dtype=bool, count=n) for ks in grouped]
        below = [np.zeros(n, dtype=bool) for _ in grouped]
        if self.lower is not None and n:
            for g, ks in enumerate(grouped):
                # A block on its way into the host pool (a store, a promotion) can get no second slot.
                absent = np.fromiter((self.manager.absent(k) for k in ks[start:limit]), dtype=bool, count=n)
                below[g] = absent & self.lower.contains(ks[start:limit])
        hits = hit_blocks([h | b for h, b in zip(host, below)], self.rules, start) if n else 0
        up: set[bytes] = set()
        for ks, b, state in zip(grouped, below, self._state):
            # A state group's hit needs the page of its last block alone.
            up.update(ks[start + i] for i in np.flatnonzero(b[:hits]) if not state or i == hits - 1)
        self._below[rid] = up
        # Always asynchronous: vLLM takes a failed load on a model of several groups only as a failed
        # request (failed_recving), never as block errors, and only a request waiting for its load can fail.
        return hits * self.block_size, hits > 0

    def _group_alloc(self, rid: str, grouped: list[list[bytes]], all_ids: Sequence[Sequence[int]], start: int,
                     nblk: int) -> None:
        """Several groups: load the hit's group blocks from the host pool, bringing up those below it first;
        a block that cannot be loaded fails the request (asynchronous, reported when its pages came up)."""
        below = self._below.pop(rid, set())
        if not all(state_block_ok(all_ids[g], start, nblk) for g, s in zip(self.group_ids, self._state) if s):
            # vLLM allocated the state group's blocks otherwise than for a hit's last boundary: nothing is
            # loaded (a state in the wrong block would give plausible, wrong tokens), the request fails.
            self._state_counts["state_refused"] += 1
            self._meta.offload_loads.append(OffloadLoad(block_ids=[], slots=[], request_id=rid,
                                                        tokens=nblk * self.block_size, fail_request=True, failed=True))
            return
        want, ids, missing, per_group = group_blocks(grouped, [all_ids[g] for g in self.group_ids], start, nblk,
                                                     lambda k: k in below or self.manager.contains(k))
        self._group_hits += np.asarray(per_group, dtype=np.int64)
        self._state_counts["state_hits"] += sum(n for n, s in zip(per_group, self._state) if s)
        _count_groups(metrics.offload_group_hits, self.group_ids, per_group)
        self.manager.lookup(grouped[self._stats_group])  # stats: a full-attention group's prompt blocks
        on_host = np.fromiter((k not in below for k in want), dtype=bool, count=len(want))
        plan = self.manager.prepare_load([k for k, h in zip(want, on_host) if h])
        up = self.manager.prepare_store([k for k, h in zip(want, on_host) if not h], leading=True)
        rising = ids[~on_host]
        self._tier["tier_hits"] += rising.size
        owner = np.repeat(np.arange(len(per_group)), per_group)  # `want` lists each group's keys in turn
        from_below = np.bincount(owner[~on_host], minlength=len(per_group))
        self._group_tier_hits += from_below
        _count_groups(metrics.offload_group_tier_hits, self.group_ids, from_below)
        self._meta.offload_loads.append(OffloadLoad(
            block_ids=np.concatenate([ids[on_host], rising[:len(up)]]).tolist(),
            slots=plan.slots.tolist() + up.slots.tolist(), request_id=rid, fetch_keys=list(up.keys),
            fetch_from=len(plan), invalid_block_ids=np.concatenate([missing, rising[len(up):]]).tolist(),
            keys=list(plan.keys) if self._keyed else [], tokens=nblk * self.block_size, fail_request=True))
        self._promotions[rid] = (plan, up)

    def build_meta(self, scheduler_output: Any = None) -> KVConnectMeta:
        """This step's loads and stores, and the engine's compute rate (vLLM's SchedulerOutput: its tokens)."""
        if any(self._state) and scheduler_output is not None:
            self._store_offers(scheduler_output)
        meta, self._meta = self._meta, KVConnectMeta()
        # A step with copies would count them as compute; without vLLM's output the step is not timed.
        self.rate.built(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
                        not (meta.offload_loads or meta.offload_stores))
        meta.seconds_per_token = self.rate.seconds_per_token
        self._load_batches.append(self._pending_loads)
        self._pending_loads = []
        return meta

    def _store_offers(self, scheduler_output: Any) -> None:
        """Plan a store for each boundary state vLLM offered this step, copied after this step's forward pass."""
        for offer in offered_states(scheduler_output, self.group_ids, self._state, self.block_size):
            request = self._requests.get(offer.request_id)
            key = self._state_key(request, offer.group, offer.boundary // self.block_size - 1) if request else None
            plan = self.manager.prepare_store([key]) if key is not None else None
            if not plan:
                continue
            job = f"{offer.request_id}\0s{offer.group}@{offer.boundary}"
            self._meta.offload_stores.append(OffloadStore(request_id=job, block_ids=[offer.block],
                                                          slots=plan.slots.tolist(), notify=False,
                                                          keys=list(plan.keys) if self._keyed else []))
            self._stores[job] = plan

    def _state_key(self, request: Request, group: int, index: int) -> bytes | None:
        """Group `group`'s key of token block `index` of a request (None while its tokens are not all known)."""
        prompt = self._keys_of(request)
        if index < len(prompt[group]):
            return prompt[group][index]
        tokens = request.all_token_ids
        if len(tokens) < (index + 1) * self.block_size:  # a token still being sampled (asynchronous scheduling)
            return None
        last = block_keys(list(tokens[:(index + 1) * self.block_size]), self.block_size, salt=self.salt)[-1]
        return group_keys([last], len(self.group_ids))[group][0]

    def _finish_store(self, job: str, failed: bool) -> None:
        """A store every rank ran: publish its keys (and pin them while they are written down), or drop them."""
        plan = self._stores.pop(job, None)
        if plan is None:
            return
        if failed and self.lower is not None and self.tp > 1:
            # A store that failed on one rank only: the others may still be writing these slots
            # down, so the slots are freed (nothing published) once every rank is done with them.
            self._abandoned[job] = plan
            return
        down = self.lower is not None and not failed and len(plan) > 0
        self.manager.complete_store(plan, not failed, pin=down)
        if down:
            self._writing[job] = plan.keys

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The oldest step's loads ran: unpin them; stores the worker finished are published."""
        self.rate.ran()
        self._add_load_credits(getattr(getattr(output, "kv_connector_stats", None), "data", None) or {})
        if self._load_batches:
            for plan in self._load_batches.pop(0):
                self.manager.complete_load(plan, True)
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVConnectWorkerMeta):
            meta = KVConnectWorkerMeta()
        failed_requests = getattr(output, "failed_recving", None) or set()
        for rid in output.finished_recving or ():
            if rid in self._promotions:
                plan, up = self._promotions.pop(rid)
                ok = rid not in meta.failed_fetches
                self.manager.complete_store(up, ok, promoted=True)
                self.manager.complete_load(plan, rid not in failed_requests)
                self._tier["promoted" if ok else "promote_failed"] += len(up)
        for rid in output.finished_sending or ():
            self._finish_store(rid, rid in meta.failed_stores)
        for job, failed in self._reports.states_stored(meta):  # every rank holds its shard of the state
            self._state_counts["state_stores"] += not failed
            self._finish_store(job, failed)
        # After the publishing above: a write-down can be reported in the step its store is.
        for rid in self._reports.written_down(meta):  # no rank reads the slots any more
            if rid in self._abandoned:
                self.manager.complete_store(self._abandoned.pop(rid), False)
                continue
            keys = self._writing.pop(rid, ())
            self.manager.unpin(keys)
            self._tier["written_down"] += len(keys)
        if self.lower is not None:
            self.lower.update(meta.disk_stored, meta.disk_gone)
        self._stats_file.write(self.stats())

    def _add_load_credits(self, worker: dict[str, Any]) -> None:
        """Sum what the workers credited this step's loads with, and note the rate they were credited at."""
        if any(k in worker for k in _LOAD_KEYS):
            for k in _LOAD_KEYS:
                self._loads[k] += float(worker.get(k, 0.0))
            self._loads["seconds_per_token_est"] = self.rate.seconds_per_token

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Store the full blocks of a finished request that the tier does not hold yet."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._keys.pop(rid, None)
        self._computed.pop(rid, None)
        self._matched.pop(rid, None)
        self._below.pop(rid, None)
        per_group = block_ids if block_ids and isinstance(block_ids[0], (list, tuple)) else (block_ids,)
        ntok = min(request.num_computed_tokens, len(request.all_token_ids))
        tokens = block_keys(list(request.all_token_ids[:ntok]), self.block_size, salt=self.salt)
        if self._grouped:
            keys, ids = stored_blocks(group_keys(tokens, len(self.group_ids)), [per_group[g] for g in self.group_ids],
                                      skip=self._state)
        else:
            ids = np.asarray(per_group[0], dtype=np.int64)
            keys = tokens[:len(ids)]
        if not keys:
            return False, None
        plan = self.manager.prepare_store(keys)
        if len(plan) == 0:
            return False, None
        src = ids[plan.positions]
        self._meta.offload_stores.append(OffloadStore(request_id=rid, block_ids=src.tolist(), slots=plan.slots.tolist(),
                                                      keys=list(plan.keys) if self._keyed else []))
        self._stores[rid] = plan
        return True, None

    def stats(self) -> dict[str, Any]:
        """The tier's counters: lookups, hits, misses, stores, loads, evictions, bytes, resident, capacity..."""
        s = self.manager.stats()
        out = {f: getattr(s, f) for f in s.__dataclass_fields__}
        out.update(self._loads)
        if self.lower is not None:
            out.update(self._tier, disk_pages=self.lower.disk_keys(), bytes_stored_per_block=self.manager.slot_bytes,
                       bytes_promoted=self._tier["promoted"] * self.manager.slot_bytes)
        if any(self._state):  # boundary states published, loaded by hits, and hits vLLM allocated otherwise
            out.update(self._state_counts)
        if len(self.group_ids) > 1:  # per KV-cache group (vLLM's order): blocks a hit took from the tiers
            out["group_hits"] = self._group_hits.tolist()
            if self.lower is not None:  # of those, the ones brought up from a lower tier (the rest: the host pool)
                out["group_tier_hits"] = self._group_tier_hits.tolist()
        return out

    def shutdown(self) -> None:
        """Close the lower tiers' lookup client."""
        if self.lower is not None:
            self.lower.close()
