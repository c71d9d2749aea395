"""The soak's P/D phase: a consumer in this process pulls from a producer process under seeded faults.

Every step holds one to four requests of one to four blocks on the producer, scrubs the consumer
blocks they will land in, starts the loads, applies the step's fault (SIGKILL and restart of the
producer, SIGSTOP shorter or longer than the load deadline, an abort in the middle of a READ, a
load started after its lease ran out, tampered params) and collects every report. After every step:
each load is reported exactly once and within its bound; a loaded request's blocks hold exactly the
bytes the producer wrote for it; a failed one's blocks are exactly the invalid block ids reported
beside it; no other consumer block changed; a fault aimed at one load failed that load only.
At the end no block is held on either side and the consumer's memory stayed bounded.
"""

from __future__ import annotations

import signal
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvconnect.errors import KVConnectError
from kvconnect.workload.soak_producer import ProducerProc, Shape
from kvconnect.workload.soak_schedule import (NONE, WAIT_SLACK_S, Clock, Schedule, Tally, content, memory_bounded,
                                              run_steps)
from kvconnect.workload.soak_tamper import TAMPERS, tampered

PD_FAULTS = ("kill_restart", "stop_short", "stop_long", "abort_mid_read", "lease_expired", *TAMPERS)
TARGETED = {"abort_mid_read", "lease_expired", *TAMPERS}  # aimed at a step's first load only
REFUSALS = (KVConnectError, ValueError, TypeError)  # what start_load raises for params it refuses


@dataclass(frozen=True)
class PDSettings:
    """Deadlines and sizes of a P/D phase (small requests: many of them, every byte checked)."""

    load_timeout_s: float = 3.0
    handshake_timeout_s: float = 1.0
    lease_s: float = 8.0
    short_lease_s: float = 0.2
    consumer_blocks: int = 256
    max_loads: int = 4
    max_blocks: int = 4
    clean: int = 300  # fault-free steps per deck of faults (about a second of them)
    shape: Shape = Shape()

    @property
    def bound_s(self) -> float:
        """The longest a load may take from start_load to its report."""
        return self.load_timeout_s + WAIT_SLACK_S


@dataclass
class Load:
    """One request of a step: where it lands, what it should hold, and how it ended."""

    handle: str
    local: np.ndarray
    seed: int
    original: dict
    params: dict
    target: bool = False
    started: float = 0.0
    refused: str = ""
    note: str = ""  # how the fault aimed at this load changed it
    outcome: str = ""
    ended: float = 0.0


@dataclass
class _Step:
    index: int
    fault: str
    rng: np.random.Generator
    loads: list[Load] = field(default_factory=list)


class PDSoak:
    """One backend's P/D soak."""

    def __init__(self, backend: str, seed: int, seconds: float, settings: PDSettings = PDSettings(),
                 wrap: Callable[[Any], Any] | None = None):
        """`wrap`: a function given the consumer's transport, returning the one to use (fault injection)."""
        self.backend, self.settings, self.wrap = backend, settings, wrap
        self.seconds = seconds
        self.schedule = Schedule(seed, backend, PD_FAULTS, settings.clean, first_clean=len(PD_FAULTS))
        self.tally = Tally(backend)
        self.producer = ProducerProc(backend, f"soak-prefill-{backend}", settings.lease_s, settings.shape)
        self.consumer: Any = None
        self.views: list[np.ndarray] = []
        self.shadow: list[np.ndarray] = []
        self.live: dict[str, Load] = {}
        self.reported: set[str] = set()
        self.ended_ids: deque[str] = deque(maxlen=64)
        self.lease_ends: Counter = Counter()  # how the producer's leases ended, by reason
        self._resume_at = 0.0

    # ---- set-up and end ----

    def _open(self) -> None:
        from kvconnect.connector import ConnectorConfig, KVConnector
        from kvconnect.transport import make_transport

        s = self.settings
        self.producer.start()
        transport = None if self.wrap is None else self.wrap(make_transport(self.backend, {}))
        self.consumer = KVConnector(ConnectorConfig(role="consumer", backend=self.backend,
                                                    engine_id=f"soak-decode-{self.backend}",
                                                    load_timeout_s=s.load_timeout_s,
                                                    handshake_timeout_s=s.handshake_timeout_s), transport=transport)
        caches = s.shape.caches(s.consumer_blocks)
        self.consumer.register_kv_caches(caches)
        self.views = [t.numpy() for t in caches.values()]
        self.shadow = [v.copy() for v in self.views]

    def run(self) -> Tally:
        """Run steps until the phase's time is up, then check that nothing is left held; the tally."""
        clock = Clock(self.seconds)
        self._open()
        try:
            step = run_steps(clock, self.tally, lambda n: self._step(_Step(n, self.schedule.fault(n), self.schedule.rng(n))))
            self._end(step)
        finally:
            if self.consumer is not None:
                self.consumer.close()
            self.producer.stop()
        return self.tally

    def _end(self, step: int) -> None:
        t = self.tally
        self._collect([ld for ld in self.live.values() if not ld.outcome], step, NONE, patience=True)
        pending = self.consumer.consumer.pending
        if pending:
            t.violation("leaks", step, NONE, f"{pending} loads never reported at the end", pending)
        held = self.producer.held_blocks(wait_s=self.settings.lease_s + 3.0)
        self.lease_ends.update(self.producer.lease_ends())
        if held:
            t.violation("leaks", step, NONE, f"the producer still holds {held} blocks after every lease ended", held)
        memory_bounded(t, step)

    # ---- one step ----

    def _step(self, st: _Step) -> None:
        if not self._prepare(st):
            return
        fault = st.fault
        if fault == "lease_expired":
            time.sleep(self.settings.short_lease_s * 1.5)
        # A producer fault lands before the loads start (handshake and claim meet it) or while they run.
        early = fault in ("stop_short", "stop_long", "kill_restart") and st.rng.random() < 0.4
        if early:
            self._producer_fault(st)
        self._start(st)
        if fault == "abort_mid_read":  # a small load ends within a millisecond: abort at once half of the time
            time.sleep(float(st.rng.uniform(0, 0.001)) if st.rng.random() < 0.5 else 0.0)
            self.consumer.abort(st.loads[0].handle)
        elif fault in ("stop_short", "stop_long", "kill_restart") and not early:
            time.sleep(float(st.rng.uniform(0, 0.0015)))
            self._producer_fault(st)
        if fault in ("stop_short", "stop_long"):
            self._resume(st)
        self._collect(st.loads, st.index, fault)
        if fault == "kill_restart":
            self._restart()
        if fault != NONE:
            self.tally.faults[fault] += 1
        self._check(st)

    def _prepare(self, st: _Step) -> bool:
        """Hold the step's requests on the producer and tamper with the target's params; False if none held."""
        s, rng = self.settings, st.rng
        count = int(rng.integers(1, s.max_loads + 1))
        sizes = rng.integers(1, s.max_blocks + 1, size=count)
        local = rng.choice(s.consumer_blocks, size=int(sizes.sum()), replace=False)
        lease = s.short_lease_s if st.fault == "lease_expired" else None
        holds = [(f"{self.backend}-{st.index}-{j}-p{self.producer.starts}", int(n),
                  self.schedule.content_seed(st.index, j), lease if j == 0 else None) for j, n in enumerate(sizes)]
        t0 = time.monotonic()
        try:
            params = self.producer.hold(holds)
            if time.monotonic() - t0 > 0.5:
                self.tally.info["steps that waited for the producer's blocks to be freed"] += 1
        except RuntimeError as exc:
            self.tally.violation("leaks", st.index, st.fault, f"the producer could not hold a request: {exc}")
            return False
        cuts = np.cumsum(sizes)[:-1]
        for j, (p, ids) in enumerate(zip(params, np.split(local, cuts))):
            st.loads.append(Load(f"{self.backend}/{st.index}/{j}", ids, holds[j][2], p, p))
        if st.fault in TAMPERS:
            ld = st.loads[0]
            ld.params, ld.note = tampered(st.fault, ld.original, rng, num_blocks=s.shape.num_blocks,
                                      ended_ids=list(self.ended_ids))
        if st.fault in TARGETED:
            st.loads[0].target = True
        return True

    def _start(self, st: _Step) -> None:
        poison = int(st.rng.integers(0, 256))
        for ld in st.loads:
            for view, shadow in zip(self.views, self.shadow):
                view[ld.local] = poison
                shadow[ld.local] = poison
        for ld in st.loads:
            ld.started = time.monotonic()
            try:
                self.consumer.start_load(ld.params, [ld.local.tolist()], handle=ld.handle)
            except REFUSALS as exc:
                ld.refused, ld.outcome = f"{type(exc).__name__}: {exc}", "refused"
                continue
            self.live[ld.handle] = ld

    def _producer_fault(self, st: _Step) -> None:
        """SIGKILL the producer, or SIGSTOP it for less or more than the load deadline (resumed by `_resume`)."""
        s = self.settings
        if st.fault == "kill_restart":
            self.lease_ends.update(self.producer.lease_ends())
            self.producer.kill()
            return
        if st.fault == "stop_short":
            pause = float(st.rng.uniform(0.05, s.load_timeout_s * 0.6))
        else:
            pause = float(st.rng.uniform(s.load_timeout_s + 0.5, s.load_timeout_s + 2.0))
        self.producer.signal(signal.SIGSTOP)
        self._resume_at = time.monotonic() + pause

    def _resume(self, st: _Step) -> None:
        """SIGCONT once the stop lasted its time (the loads' reports are collected meanwhile)."""
        self._collect(st.loads, st.index, st.fault, until=self._resume_at)
        self.producer.signal(signal.SIGCONT)

    def _restart(self) -> None:
        try:
            self.producer.start()
        except RuntimeError:
            self.producer.kill()
            self.producer.port = 0  # the old port was not free again: a fresh one
            self.producer.start()

    # ---- reports and invariants ----

    def _collect(self, loads: list[Load], step: int, fault: str, until: float | None = None,
                 patience: bool = False) -> None:
        """Take reports until every load in `loads` ended (or `until`; a late load waits up to twice its bound)."""
        open_ = [ld for ld in loads if not ld.outcome]
        give_up = max([ld.started for ld in open_], default=0.0) + self.settings.bound_s * (3 if patience else 2)
        while open_:
            now = time.monotonic()
            if (until is not None and now >= until) or now >= give_up:
                break
            self._take(step, fault)
            open_ = [ld for ld in open_ if not ld.outcome]
            time.sleep(0.0005)
        if until is None:
            for ld in open_:
                self.tally.violation("late", step, fault, f"load {ld.handle} not reported within "
                                                          f"{give_up - ld.started:.1f} s")
        if until is not None and now < until:
            time.sleep(max(0.0, until - time.monotonic()))

    def _take(self, step: int, fault: str) -> None:
        """One get_finished(): each handle once, ours, and the invalid ids exactly the failed loads' blocks."""
        fin, now, t = self.consumer.get_finished(), time.monotonic(), self.tally
        both = set(fin.loaded) & set(fin.failed)
        if both:
            t.violation("double_reports", step, fault, f"reported loaded and failed at once: {sorted(both)}", len(both))
        expect_invalid: set[int] = set()
        for handle, outcome in [(h, "loaded") for h in fin.loaded] + [(h, "failed") for h in fin.failed]:
            if handle in self.reported:
                t.violation("double_reports", step, fault, f"load {handle} reported again ({outcome})")
                continue
            ld = self.live.pop(handle, None)
            if ld is None:
                t.violation("unknown_reports", step, fault, f"a report of {handle}, which was never started")
                continue
            self.reported.add(handle)
            ld.outcome, ld.ended = outcome, now
            if outcome == "failed":
                expect_invalid.update(ld.local.tolist())
            if outcome == "loaded" and not ld.target:  # read and done: that lease has ended
                self.ended_ids.append(ld.original["request_id"])
        if set(fin.invalid_block_ids) != expect_invalid:
            t.violation("invalid_mismatch", step, fault, f"invalid_block_ids {sorted(fin.invalid_block_ids)[:8]} "
                                                         f"!= the failed loads' blocks {sorted(expect_invalid)[:8]}")

    def _check(self, st: _Step) -> None:
        t, s = self.tally, self.settings
        touched = np.zeros(s.consumer_blocks, dtype=bool)
        for ld in st.loads:
            t.requests += 1
            touched[ld.local] = True
            if ld.ended:
                t.waited(ld.ended - ld.started, s.bound_s, st.index, st.fault, f"load {ld.handle}")
            if ld.outcome == "refused":
                t.refused += 1
            elif ld.outcome == "failed":
                t.failed += 1
                if st.fault != NONE:
                    t.info[f"failed under {st.fault}"] += 1
            elif ld.outcome == "loaded":
                self._loaded(st, ld)
            if ld.target and st.fault == "abort_mid_read":
                t.info["aborts that landed" if ld.outcome == "failed" else "aborts after the load ended"] += 1
            elif ld.target and ld.outcome == "loaded":
                t.violation("tampered_accepted", st.index, st.fault,
                            f"load {ld.handle} loaded despite {ld.note or st.fault}")
            elif not ld.target and st.fault in TARGETED and ld.outcome != "loaded":
                t.violation("collateral", st.index, st.fault, f"load {ld.handle} beside the target ended "
                                                              f"{ld.outcome or 'unreported'} {ld.refused}")
            if ld.target and ld.params is not ld.original:
                self._release(ld)
        self._untouched(st, touched)

    def _loaded(self, st: _Step, ld: Load) -> None:
        s = self.settings
        want = content(ld.seed, s.shape.regions, ld.local.size, s.shape.row_bytes)
        if all(np.array_equal(view[ld.local], want[k]) for k, view in enumerate(self.views)):
            self.tally.exact += 1
        else:
            self.tally.violation("wrong_bytes", st.index, st.fault, f"load {ld.handle} reported loaded with "
                                                                    "bytes other than the prefill's")

    def _release(self, ld: Load) -> None:
        """A tampered load never read the real lease: free it now rather than at its expiry."""
        try:
            self.consumer.release_remote(ld.original)
        except REFUSALS:  # still being read by the tampered load (unreported): its lease expires instead
            pass

    def _untouched(self, st: _Step, touched: np.ndarray) -> None:
        """No block outside the step's loads changed; then the step's blocks become the new reference."""
        changed = np.zeros_like(touched)
        for view, shadow in zip(self.views, self.shadow):
            changed |= (view != shadow).any(axis=1)
            shadow[touched] = view[touched]
        stray = changed & ~touched
        if stray.any():
            self.tally.violation("stray_writes", st.index, st.fault, f"blocks {np.flatnonzero(stray)[:8].tolist()} "
                                                                     "changed outside every load of the step")
