"""What a soak under random faults shares: its seeded schedule, the blocks' seeded bytes and the tally.

A soak runs phases (one per backend, one for the offload tiers), each a sequence of numbered steps.
The fault of step `i` of a phase depends only on the seed, the phase and `i`: faults are dealt from
decks holding every fault kind once and a number of fault-free steps, each deck shuffled by the
seeded generator, so a short run still meets every kind and a long one meets each many times. The
parameters of a step (how many requests, how many blocks, which byte to flip, how long to stop a
process) come from a generator seeded by (seed, phase, step) alone, never from the clock: the same
seed replays the same schedule, and the report names the first step that broke an invariant.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

NONE = "none"  # a step without a fault
# Seconds a wait may run past its own deadline before it counts as late: a cancelled transfer is
# reported only once its backend says nothing more can land, which takes a poll or two.
WAIT_SLACK_S = 2.5


def phase_id(phase: str) -> int:
    """A stable number for a phase name (Python's own hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(phase.encode(), digest_size=4).digest(), "little")


class Schedule:
    """The seeded fault of each step of one phase, and each step's own generator."""

    def __init__(self, seed: int, phase: str, kinds: Sequence[str], clean: int, first_clean: int | None = None):
        """`clean` fault-free steps per deck; the first deck has `first_clean` (so a short run meets every kind)."""
        self.seed, self.phase, self.kinds = int(seed), phase, list(kinds)
        self.clean, self.first_clean = clean, clean if first_clean is None else first_clean
        self._deck_rng = np.random.default_rng([self.seed, phase_id(phase)])
        self._steps: list[str] = []

    def fault(self, step: int) -> str:
        """The fault of step `step` (NONE for a fault-free one)."""
        while len(self._steps) <= step:
            clean = self.first_clean if not self._steps else self.clean
            deck = self.kinds + [NONE] * clean
            self._steps += [deck[i] for i in self._deck_rng.permutation(len(deck))]
        return self._steps[step]

    def rng(self, step: int) -> np.random.Generator:
        """The generator of step `step`'s parameters."""
        return np.random.default_rng([self.seed, phase_id(self.phase), step])

    def content_seed(self, step: int, index: int) -> int:
        """The seed of the bytes of request `index` of step `step` (what the prefill writes)."""
        digest = hashlib.blake2b(f"{self.seed}/{self.phase}/{step}/{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")


def content(seed: int, regions: int, count: int, row_bytes: int) -> np.ndarray:
    """The seeded bytes of `count` blocks: shape (regions, count, row_bytes), uint8, the same in every process."""
    raw = np.random.default_rng(seed).bytes(regions * count * row_bytes)
    return np.frombuffer(raw, dtype=np.uint8).reshape(regions, count, row_bytes)


def quiet_logs(quiet: bool) -> None:
    """Keep the soak's expected failures (thousands of them) out of the log: errors only, unless asked."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if quiet:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's own log: every refused peer is a line
        for name in ("kvconnect", "nixl"):
            logging.getLogger(name).setLevel(logging.ERROR)


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is absent)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# Counters a phase reports; each name in VIOLATIONS breaks an invariant when it is above zero.
VIOLATIONS = ("wrong_bytes", "double_reports", "unknown_reports", "invalid_mismatch", "stray_writes", "late",
              "collateral", "tampered_accepted", "start_failed", "leaks", "memory")


@dataclass
class Tally:
    """Counts of one phase, its worst wait against that wait's bound, and the first step that broke an invariant."""

    phase: str
    requests: int = 0
    exact: int = 0
    failed: int = 0
    refused: int = 0
    misses: int = 0  # tier loads that found fewer blocks than were stored (recomputed, never wrong)
    faults: Counter = field(default_factory=Counter)
    not_made: dict[str, str] = field(default_factory=dict)  # fault kind -> why it could not be made real
    worst_wait_s: float = 0.0
    worst_bound_s: float = 0.0
    rss_warm: int = 0
    rss_end: int = 0
    steps: int = 0
    seconds: float = 0.0
    counts: Counter = field(default_factory=Counter)
    info: Counter = field(default_factory=Counter)  # what happened that breaks nothing (how faults ended)
    first_failure: str = ""

    def violation(self, kind: str, step: int, fault: str, text: str, n: int = 1) -> None:
        """Count `n` breaches of invariant `kind` at `step`; the first one of the phase is kept for the report."""
        if kind not in VIOLATIONS:
            raise ValueError(f"unknown invariant {kind!r}")
        self.counts[kind] += n
        if not self.first_failure:
            self.first_failure = f"{self.phase} step {step} (fault {fault}): {kind}: {text}"

    def waited(self, seconds: float, bound: float, step: int, fault: str, what: str) -> None:
        """Record one wait; past its bound it is late."""
        if bound > 0 and seconds / bound > (self.worst_wait_s / self.worst_bound_s if self.worst_bound_s else -1):
            self.worst_wait_s, self.worst_bound_s = seconds, bound
        if seconds > bound:
            self.violation("late", step, fault, f"{what} waited {seconds:.2f} s, bound {bound:.2f} s")

    @property
    def violations(self) -> int:
        """Breaches of every invariant together."""
        return sum(self.counts[k] for k in VIOLATIONS)

    def as_dict(self) -> dict:
        """Plain data for the JSON report."""
        out = {k: getattr(self, k) for k in ("phase", "requests", "exact", "failed", "refused", "misses", "steps",
                                             "worst_wait_s", "worst_bound_s", "rss_warm", "rss_end",
                                             "first_failure")}
        out.update({k: self.counts[k] for k in VIOLATIONS}, faults=dict(self.faults), not_made=dict(self.not_made),
                   info=dict(self.info), seconds=round(self.seconds, 1))
        return out


def memory_bounded(tally: Tally, step: int, allowance: int = 0, why: str = "") -> None:
    """The end RSS against the one after warm-up: a generous bound (half again, at least 128 MiB more),
    plus `allowance` bytes a library is known to keep (`why` says what, in the report)."""
    tally.rss_end = rss_bytes()
    bound = max(128 << 20, tally.rss_warm // 2) + allowance
    if allowance:
        tally.info["memory allowance"] = f"{allowance >> 20} MiB ({why})"
    if tally.rss_warm and tally.rss_end - tally.rss_warm > bound:
        tally.violation("memory", step, NONE, f"RSS grew from {tally.rss_warm >> 20} MiB after warm-up to "
                                              f"{tally.rss_end >> 20} MiB (bound: {bound >> 20} MiB more)")


WARM_STEPS = 30  # steps before the RSS that memory_bounded compares against is taken


def run_steps(clock: Clock, tally: Tally, step: Callable[[int], None]) -> int:
    """Call `step(n)` for n = 0, 1, ... until the clock runs out, taking the warm RSS on the way; the count."""
    n = 0
    try:
        while clock.left() > 0:
            step(n)
            n += 1
            if n == WARM_STEPS:
                tally.rss_warm = rss_bytes()
    finally:
        tally.steps, tally.seconds = n, time.monotonic() - clock.start
    return n


class Clock:
    """Monotonic seconds since a phase started, and its end."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left(self) -> float:
        """Seconds left in the phase."""
        return self.end - time.monotonic()
