"""`kvconnect bench soak`: a short fixed-seed run of real faults holds every invariant, and a wrong byte fails it."""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvconnect.faults import FaultyTransport
from kvconnect.transport.base import TransferState
from kvconnect.workload.soak_pd import PD_FAULTS
from kvconnect.workload.soak_schedule import NONE, Schedule, Tally, content
from kvconnect.workload.soak_tamper import TAMPERS, tampered
from kvconnect.workload.soak_tiers import TIER_FAULTS

ROOT = Path(__file__).resolve().parents[1]
SEED = 1


# ---- the schedule and the tally, no backend ----

def test_the_same_seed_deals_the_same_faults_and_every_deck_holds_every_kind():
    a, b = Schedule(SEED, "nixl", PD_FAULTS, clean=20), Schedule(SEED, "nixl", PD_FAULTS, clean=20)
    steps = [a.fault(i) for i in range(300)]
    assert steps == [b.fault(i) for i in range(300)]
    assert steps != [Schedule(SEED + 1, "nixl", PD_FAULTS, clean=20).fault(i) for i in range(300)]
    deck = len(PD_FAULTS) + 20
    for start in range(0, 300 - deck + 1, deck):
        hand = steps[start:start + deck]
        assert sorted(k for k in hand if k != NONE) == sorted(PD_FAULTS) and hand.count(NONE) == 20
    assert np.array_equal(a.rng(7).integers(0, 1 << 30, 4), b.rng(7).integers(0, 1 << 30, 4))
    assert np.array_equal(content(3, 2, 4, 64), content(3, 2, 4, 64))


def test_a_dense_first_deck_meets_every_fault_within_its_first_steps():
    s = Schedule(SEED, "tiers", TIER_FAULTS, clean=3000, first_clean=len(TIER_FAULTS))
    assert set(TIER_FAULTS) <= {s.fault(i) for i in range(2 * len(TIER_FAULTS))}


@pytest.mark.parametrize("kind", TAMPERS)
def test_tampered_params_differ_from_the_issued_ones(kind):
    params = {"engine_id": "p", "host": "127.0.0.1", "port": 5555, "request_id": "r1", "block_ids": [[1, 2, 3]],
              "num_tokens": 48, "lease_expiry": 1.0, "incarnation": "i"}
    for seed in range(8):
        out, why = tampered(kind, params, np.random.default_rng(seed), num_blocks=16, ended_ids=["old"])
        assert out != params and why and params["block_ids"] == [[1, 2, 3]]  # the original is untouched


def test_the_tally_keeps_the_first_failing_step_and_refuses_unknown_invariants():
    t = Tally("nixl")
    t.waited(1.0, 5.0, 0, NONE, "load a")
    t.violation("wrong_bytes", 12, "stop_short", "load x")
    t.waited(6.0, 5.5, 13, NONE, "load b")
    assert t.violations == 2 and t.first_failure.startswith("nixl step 12 (fault stop_short): wrong_bytes")
    assert (t.worst_wait_s, t.worst_bound_s) == (6.0, 5.5)
    with pytest.raises(ValueError):
        t.violation("no-such-invariant", 0, NONE, "")


# ---- real processes, real backends ----

def test_soak_of_both_backends_and_the_tiers_makes_every_fault_and_holds_every_invariant():
    out = subprocess.run([sys.executable, "-m", "kvconnect.cli", "bench", "soak", "--minutes", "1", "--seed",
                          str(SEED), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.stdout.strip(), out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, (report["first_failure"], report["totals"])
    phases = {p["phase"]: p for p in report["phases"]}
    assert set(phases) == {"nixl", "mooncake", "tiers"}
    for name in ("nixl", "mooncake"):
        p = phases[name]
        assert set(p["faults"]) == set(PD_FAULTS), (name, p["faults"])
        assert p["exact"] > 100 and p["failed"] > 0, p
        assert p["worst_wait_s"] <= p["worst_bound_s"]
    tiers = phases["tiers"]
    assert set(tiers["faults"]) | set(tiers["not_made"]) == set(TIER_FAULTS), tiers
    assert tiers["exact"] > 100
    assert report["totals"]["wrong_bytes"] == 0 and report["totals"]["leaks"] == 0


class CorruptingTransport(FaultyTransport):
    """A READ that completes with one byte of its first local block flipped: what a broken backend would do."""

    def __init__(self, inner):
        super().__init__(inner)
        self.first_block: dict[int, int] = {}
        self.flipped = 0

    def register(self, regions):
        self.regions = regions
        super().register(regions)

    def post(self, op, peer_id, local_ids=None, remote_ids=None, *, regions=None):
        handle = super().post(op, peer_id, local_ids, remote_ids, regions=regions)
        ids = op.local_ids if local_ids is None else local_ids
        self.first_block[id(handle)] = int(np.asarray(ids).reshape(-1)[0])
        return handle

    def poll(self, handle):
        state = super().poll(handle)
        block = self.first_block.pop(id(handle), None) if state is TransferState.DONE else None
        if block is not None:
            region = self.regions[0]
            byte = ctypes.c_uint8.from_address(region.base_addr + block * region.block_stride + 5)
            byte.value ^= 0x10
            self.flipped += 1
        return state


def test_a_block_corrupted_in_transit_is_counted_as_wrong_bytes_and_fails_the_soak():
    from kvconnect.bench.soak import soak

    made: list[CorruptingTransport] = []

    def wrap(inner):
        made.append(CorruptingTransport(inner))
        return made[0]

    args = argparse.Namespace(minutes=0.1, seed=SEED, backend="nixl", no_tiers=True, json=True, verbose=False)
    code, report = soak(args, wrap=wrap)
    assert made and made[0].flipped > 0
    assert code == 1
    assert report["totals"]["wrong_bytes"] > 0
    assert "wrong_bytes" in report["first_failure"] and report["first_failure"].startswith("nixl step ")
