"""The soak's tier phase: an offload connector over a disk tier and a real Mooncake Store, under faults.

Every step stores a new request's blocks (seeded bytes, unique tokens) through a host pool of a few
slots, so older requests live only in the lower tiers, then loads an earlier request back by prefix
into scrubbed blocks. The step's fault is one of: the master killed while a load runs and started
again, the master stopped for a moment, a flipped byte in a disk batch file or in a store object,
the disk tier's filesystem full for a few steps, the connector closed and opened again on the same
disk and store. After every step: the load's leading hits hold exactly the stored bytes, blocks
past them are untouched, no other block changed, every job ends once and within its bound; a
failed load or a miss is a recompute, never wrong bytes. At the end no slot is pinned or in flight.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvconnect.offload.tiers.store import clients_set_up
from kvconnect.workload.soak_producer import Shape
from kvconnect.workload.soak_schedule import (NONE, WAIT_SLACK_S, Clock, Schedule, Tally, content, memory_bounded,
                                              run_steps)
from kvconnect.workload.soak_tierfaults import Ground

TIER_FAULTS = ("master_restart", "master_stall", "flip_disk", "flip_store", "full_disk", "reopen")
HISTORY = 400  # requests a load may go back to


@dataclass(frozen=True)
class TierSettings:
    """Sizes and deadlines of the tier phase."""

    host_slots: int = 8
    disk_bytes: int = 1 << 20
    timeout_s: float = 3.0
    max_blocks: int = 4
    clean: int = 3000  # fault-free steps per deck (some 10 s: the store refills after a master restart)
    shape: Shape = Shape(num_blocks=64)

    @property
    def bound_s(self) -> float:
        """The longest a job may take from submission to its end."""
        return self.timeout_s + WAIT_SLACK_S


@dataclass
class _Stored:
    tokens: list[int]
    seed: int
    count: int


class TierSoak:
    """The offload tiers' soak."""

    def __init__(self, seed: int, seconds: float, settings: TierSettings = TierSettings()):
        self.seconds, self.settings = seconds, settings
        self.schedule = Schedule(seed, "tiers", TIER_FAULTS, settings.clean, first_clean=len(TIER_FAULTS))
        self.tally = Tally("tiers")
        self.ground: Ground | None = None
        self.master = ""
        self.conn: Any = None
        self.views: list[np.ndarray] = []
        self.shadow: list[np.ndarray] = []
        self.caches: dict = {}
        self.history: list[_Stored] = []
        self.jobs: dict[int, Any] = {}  # submitted, not yet seen in poll()
        self.polled: set[int] = set()
        self.submitted: dict[int, float] = {}
        self.full_until = -1
        self.load_next: _Stored | None = None

    # ---- set-up and end ----

    def _open(self) -> None:
        from kvconnect.offload import OffloadConnector
        from kvconnect.offload.tiers.disk import DiskTier
        from kvconnect.offload.tiers.store import StoreTier

        s = self.settings
        tiers = [DiskTier(self.ground.tier_dir, s.disk_bytes)]
        if self.master:
            tiers.append(StoreTier(self.master, retry_s=1.0))
        slot = s.shape.regions * s.shape.row_bytes
        self.conn = OffloadConnector(cpu_bytes=s.host_slots * slot, timeout_s=s.timeout_s, tiers=tiers)
        self.conn.register_kv_caches(self.caches)

    def run(self) -> Tally:
        """Run steps until the phase's time is up, then check that nothing is left pinned; the tally."""
        clock = Clock(self.seconds)
        self._clients_at_start = clients_set_up()
        self.ground = Ground()
        self.tally.not_made.update(self.ground.not_made)
        try:
            self.master = self.ground.start_store()
            self.tally.not_made.update(self.ground.not_made)
            self.caches = self.settings.shape.caches()
            self.views = [t.numpy() for t in self.caches.values()]
            self.shadow = [v.copy() for v in self.views]
            self._open()
            step = run_steps(clock, self.tally, lambda n: self._step(n, self.schedule.fault(n), self.schedule.rng(n)))
            self._end(step)
        finally:
            if self.conn is not None:
                self._close_conn()
            self.ground.close()
        return self.tally

    def _close_conn(self) -> None:
        try:
            self.conn.close(timeout=self.settings.bound_s)
        finally:
            self.conn = None

    def _end(self, step: int) -> None:
        t = self.tally
        self.ground.unfill()
        self.conn.flush_tiers(self.settings.bound_s)
        self._settle(step, NONE)
        pinned, in_flight = self.conn.manager.pinned(), self.conn.stats().in_flight
        if pinned or in_flight:
            t.violation("leaks", step, NONE, f"{pinned} host slots pinned, {in_flight} blocks in flight at the end",
                        pinned + in_flight)
        # Mooncake's store client keeps about 6 MiB each time one is set up (measured, with earlier
        # kvconnect releases too); the tier sets up one per reopen and per master restart.
        clients = clients_set_up() - self._clients_at_start
        memory_bounded(t, step, clients * (8 << 20), f"8 MiB for each of {clients} Mooncake Store clients set up")

    # ---- one step ----

    def _step(self, step: int, fault: str, rng: np.random.Generator) -> None:
        if step == self.full_until:
            self.ground.unfill()
        made = self._before(step, fault, rng)
        self._store(step, fault, rng)
        if self.history:
            self._load(step, fault, rng)
        if made:
            self.tally.faults[fault] += 1
        self._poll(step, fault)

    def _before(self, step: int, fault: str, rng: np.random.Generator) -> bool:
        """Apply the faults that come before the step's moves; whether the fault was made."""
        g = self.ground
        if fault in self.tally.not_made:
            return False
        if fault == "flip_disk":
            return self._note(fault, g.flip_disk(rng))
        if fault == "flip_store":
            return self._flip_store(rng)
        if fault == "full_disk":
            self.full_until = step + int(rng.integers(3, 12))
            return self._note(fault, f"{g.fill()} bytes of filler")
        if fault == "reopen":
            self._settle(step, fault)
            self._close_conn()
            try:
                self._open()
            except Exception as exc:  # the engine could not start on what the tiers left behind
                full = " (the disk was full)" if self.full_until > step else ""
                self.tally.violation("start_failed", step, fault, f"{type(exc).__name__}: {exc}{full}")
                g.unfill()  # as an operator would: free the disk, set the damaged files aside, start again
                self.full_until = -1
                g.tier_dir.rename(g.tier_dir.with_name(f"tier-unusable-{step}"))
                g.tier_dir.mkdir()
                self._open()
            return True
        return fault in ("master_restart", "master_stall")

    def _flip_store(self, rng: np.random.Generator) -> bool:
        """Flip a byte of a stored object of an old request (or a recent one: a restarted master forgot the
        old ones); the step's load then asks for that request."""
        for attempt in range(6):
            if not self.history:
                break
            far = attempt < 3
            pick = int(rng.integers(0, len(self.history))) if far else len(self.history) - 1 - int(rng.integers(0, 8))
            old = self.history[max(pick, 0)]
            key = self.conn.block_keys(old.tokens)[int(rng.integers(0, old.count))]
            if self.ground.flip_store(self._object_name(key), rng):
                self.load_next = old
                return True
        return self._note("flip_store", "")

    def _note(self, fault: str, what: str) -> bool:
        if not what:
            self.tally.info[f"{fault} not applied (nothing to damage yet)"] += 1
        return bool(what)

    def _object_name(self, key: bytes) -> str:
        from kvconnect.offload.tiers.integrity import namespace_of

        return f"kvc/{namespace_of(b'', self.conn.slot_bytes).hex()}/{key.hex()}"

    def _store(self, step: int, fault: str, rng: np.random.Generator) -> None:
        s = self.settings
        count = int(rng.integers(1, s.max_blocks + 1))
        seed = self.schedule.content_seed(step, 0)
        tokens = [step + 1, *rng.integers(0, 1 << 20, count * self.conn.block_size - 1).tolist()]
        src = rng.choice(s.shape.num_blocks // 2, size=count, replace=False)
        rows = content(seed, s.shape.regions, count, s.shape.row_bytes)
        for k, view in enumerate(self.views):
            view[src] = rows[k]
            self.shadow[k][src] = rows[k]
        job = self._submit(lambda: self.conn.store_request(tokens, src))
        if job is not None and self._wait(job, step, fault, "store") and job.error is None:
            self.history = (self.history + [_Stored(tokens, seed, count)])[-HISTORY:]
        self.conn.flush_tiers(0.2 if step != self.full_until else 0.0)

    def _submit(self, make: Any) -> Any:
        t0 = time.monotonic()
        job = make()
        self.jobs[job.id] = job
        self.submitted[job.id] = t0
        return job

    def _wait(self, job: Any, step: int, fault: str, what: str) -> bool:
        t0 = self.submitted.pop(job.id)
        done = job.wait(max(0.0, t0 + self.settings.bound_s - time.monotonic()))
        self.tally.waited(time.monotonic() - t0, self.settings.bound_s, step, fault, f"{what} job {job.id}")
        return done

    def _load(self, step: int, fault: str, rng: np.random.Generator) -> None:
        s, t = self.settings, self.tally
        # Half the loads go far back, where only the lower tiers (the store, past the disk's size) hold them.
        pick = int(rng.integers(0, len(self.history))) if rng.random() < 0.5 else int(rng.integers(0, 8))
        old = self.history[pick if pick < len(self.history) else -1]
        if self.load_next is not None:
            old, self.load_next = self.load_next, None
        dst = s.shape.num_blocks // 2 + rng.choice(s.shape.num_blocks // 2, size=old.count, replace=False)
        poison = int(rng.integers(0, 256))
        for view, shadow in zip(self.views, self.shadow):
            view[dst] = poison
            shadow[dst] = poison
        keys = self.conn.block_keys(old.tokens)
        early = rng.random() < 0.5  # a master fault before the load asks for anything, or while it runs
        if early:
            self._master_fault(fault, rng)
        job = self._submit(lambda: self.conn.load_prefix(keys, dst))
        if not early:
            time.sleep(float(rng.uniform(0, 0.002)))
            self._master_fault(fault, rng)
        done = self._wait(job, step, fault, "load")
        if fault == "master_restart" and self.ground.store is not None:
            self.ground.start_master()
        t.requests += 1
        if not done:
            return  # counted late; its blocks are checked again once it ends (stray writes otherwise)
        self._check_load(step, fault, job, old, dst, poison)

    def _master_fault(self, fault: str, rng: np.random.Generator) -> None:
        """The master killed (started again once the load ended), or stopped for a moment."""
        g = self.ground
        if g.store is None:
            return
        if fault == "master_restart":
            g.kill_master()
        elif fault == "master_stall":
            g.store.master.send_signal(signal.SIGSTOP)
            try:
                time.sleep(float(rng.uniform(0.2, 2.0)))
            finally:
                g.store.master.send_signal(signal.SIGCONT)

    def _check_load(self, step: int, fault: str, job: Any, old: _Stored, dst: np.ndarray, poison: int) -> None:
        s, t = self.settings, self.tally
        if job.error is not None:
            t.failed += 1
            if fault != NONE:
                t.info[f"failed under {fault}"] += 1
            stray_ok = dst
        else:
            hits = job.num_blocks
            want = content(old.seed, s.shape.regions, old.count, s.shape.row_bytes)
            if not all(np.array_equal(v[dst[:hits]], want[k][:hits]) for k, v in enumerate(self.views)):
                t.violation("wrong_bytes", step, fault, f"load job {job.id} reported {hits} blocks with bytes "
                                                        "other than those stored")
            elif hits == old.count:
                t.exact += 1
            else:  # the leading hits are exact; the rest is recomputed
                t.misses += 1
            stray_ok = dst[:hits]  # blocks past the hits must still hold the poison
        touched = np.zeros(s.shape.num_blocks, dtype=bool)
        touched[stray_ok] = True
        changed = np.zeros_like(touched)
        for view, shadow in zip(self.views, self.shadow):
            changed |= (view != shadow).any(axis=1)
            shadow[touched] = view[touched]
        if (changed & ~touched).any():
            t.violation("stray_writes", step, fault, f"blocks {np.flatnonzero(changed & ~touched)[:8].tolist()} "
                                                     f"changed outside the loaded ones (poison {poison})")

    def _settle(self, step: int, fault: str) -> None:
        """Poll until every job submitted was reported (they all ended: each was waited for)."""
        deadline = time.monotonic() + self.settings.bound_s
        while True:
            self._poll(step, fault)
            if not self.jobs or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        if self.jobs:
            self.tally.violation("leaks", step, fault, f"{len(self.jobs)} ended jobs never reported by poll()",
                                 len(self.jobs))
            self.jobs.clear()

    def _poll(self, step: int, fault: str) -> None:
        for job in self.conn.poll() if self.conn is not None else ():
            if job.id in self.polled:
                self.tally.violation("double_reports", step, fault, f"job {job.id} reported by poll() twice")
                continue
            if self.jobs.pop(job.id, None) is None:
                self.tally.violation("unknown_reports", step, fault, f"poll() reported job {job.id}, never submitted")
                continue
            self.polled.add(job.id)
