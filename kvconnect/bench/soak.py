"""`kvconnect bench soak`: thousands of requests under a seeded schedule of real faults, invariants checked after each.

Phases run one after the other and share the time: P/D over NIXL, P/D over Mooncake (tcp,
P2PHANDSHAKE), each with a real producer process, and the offload tiers over a disk tier on a 4 MiB
tmpfs and a real Mooncake Store (`mooncake_master` and a storage node). Faults: SIGKILL and restart
of the producer, SIGSTOP/SIGCONT of it (shorter and longer than the load deadline), aborts in the
middle of a READ, loads started after their lease ran out, tampered params (unknown or ended request
id, out-of-range block ids, another engine's id, garbled or dead address); the master killed during a
load and started again, the master stopped, flipped bytes in disk batch files and in store objects,
a full disk, the offload connector restarted on what the tiers left behind.

Invariants after every request: the loaded blocks equal the prefill's bytes exactly, or the request
is reported failed with exactly its blocks invalid (tiers: the leading hits exact, the rest a miss
that is recomputed); each request reported once; every wait within its bound; no other block
touched; a fault aimed at one load fails that load only. At the end: no block held on either side,
no slot pinned, and the consumer's memory bounded. Exit code 1 on any violation, with the seed and
the first failing step; the same seed deals the same schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from kvconnect.cliargs import positive_float

EPILOG = """invariants: loaded bytes equal the prefill's exactly, else failed with exactly its blocks invalid; each
request reported once; every wait within its bound; no other block touched; a fault aimed at one load
fails it alone; at the end nothing held or pinned and memory bounded. Exit 0: all held; 1: a violation
(the seed and the first failing step are printed; rerun with the same --seed to replay the schedule).
The full-disk fault mounts a 4 MiB tmpfs and needs root (else it is reported as not made)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvconnect bench soak`."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--minutes", type=positive_float, default=10.0,
                        help="total run time, shared equally by the phases (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and of every byte (default 0)")
    parser.add_argument("--backend", default="both", choices=["nixl", "mooncake", "both"],
                        help="P/D phases to run (default both)")
    parser.add_argument("--no-tiers", action="store_true", help="skip the offload-tier phase")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--verbose", action="store_true", help="keep kvconnect's and the backends' logs of "
                                                               "every expected failure")


def phases(args: argparse.Namespace) -> list[str]:
    """The phases a command line asks for, in the order they run."""
    out = ["nixl", "mooncake"] if args.backend == "both" else [args.backend]
    return out if args.no_tiers else [*out, "tiers"]


def soak(args: argparse.Namespace, wrap: Callable[[Any], Any] | None = None) -> tuple[int, dict]:
    """Run every phase; (exit code, report). `wrap` wraps the P/D consumers' transports (fault injection)."""
    from kvconnect.workload.soak_pd import PDSoak
    from kvconnect.workload.soak_schedule import quiet_logs
    from kvconnect.workload.soak_tiers import TierSoak

    quiet_logs(not args.verbose)
    names = phases(args)
    seconds = args.minutes * 60.0 / len(names)
    tallies = []
    for name in names:
        if not args.json:
            print(f"  phase {name}: {seconds:.0f} s ...", file=sys.stderr, flush=True)
        run = TierSoak(args.seed, seconds) if name == "tiers" else PDSoak(name, args.seed, seconds, wrap=wrap)
        tallies.append(run.run())
    report = _report(args, names, tallies)
    return (1 if report["violations"] else 0), report


def _report(args: argparse.Namespace, names: list[str], tallies: list) -> dict:
    from kvconnect.workload.soak_schedule import VIOLATIONS

    per = [t.as_dict() for t in tallies]
    totals = {k: sum(p[k] for p in per) for k in ("requests", "exact", "failed", "refused", "misses", *VIOLATIONS)}
    worst = max(per, key=lambda p: p["worst_wait_s"] / p["worst_bound_s"] if p["worst_bound_s"] else 0)
    first = next((p["first_failure"] for p in per if p["first_failure"]), "")
    faults: dict[str, int] = {}
    for p in per:
        for kind, n in p["faults"].items():
            faults[kind] = faults.get(kind, 0) + n
    again = f"kvconnect bench soak --minutes {args.minutes:g} --seed {args.seed} --backend {args.backend}" + \
            (" --no-tiers" if args.no_tiers else "")
    return {"seed": args.seed, "minutes": args.minutes, "phases": per, "totals": totals, "faults": faults,
            "worst_wait_s": worst["worst_wait_s"], "worst_bound_s": worst["worst_bound_s"],
            "violations": sum(totals[k] for k in VIOLATIONS), "first_failure": first, "reproduce": again}


def _print(report: dict) -> None:
    from kvconnect.workload.soak_schedule import VIOLATIONS

    names = [p["phase"] for p in report["phases"]]
    print(f"kvconnect bench soak: seed {report['seed']}, {report['minutes']:g} min, phases {', '.join(names)}")
    cols = {"steps": "steps", "requests": "requests", "exact": "exact", "failed": "failed", "refused": "refused",
            "misses": "misses", "wrong_bytes": "wrong", "double_reports": "double", "leaks": "leaks", "late": "late"}
    print("  " + f"{'phase':9s}" + "".join(f"{c:>9s}" for c in cols.values()) + "   worst wait / bound")
    for p in report["phases"]:
        print("  " + f"{p['phase']:9s}" + "".join(f"{p[c]:>9d}" for c in cols) +
              f"   {p['worst_wait_s']:.2f} s / {p['worst_bound_s']:.2f} s   ({p['seconds']:.0f} s, RSS "
              f"{p['rss_warm'] >> 20} -> {p['rss_end'] >> 20} MiB)")
    print("  faults made:")
    for p in report["phases"]:
        print(f"    {p['phase']:9s}" + ", ".join(f"{k} {v}" for k, v in sorted(p["faults"].items())))
        for kind, why in p["not_made"].items():
            print(f"    {'':9s}NOT MADE {kind}: {why}")
        if p["info"]:
            print(f"    {'':9s}(" + "; ".join(f"{k} {v}" for k, v in sorted(p["info"].items())) + ")")
    t = report["totals"]
    print(f"  totals: {t['requests']} requests, {sum(report['faults'].values())} faults, {t['exact']} loads exact, "
          f"{t['failed']} loads failed, {t['refused']} refused at start, {t['misses']} tier misses; "
          f"{t['wrong_bytes']} wrong bytes, {t['double_reports']} double reports, {t['leaks']} leaks; worst wait "
          f"{report['worst_wait_s']:.2f} s of its bound {report['worst_bound_s']:.2f} s")
    if report["violations"]:
        broken = ", ".join(f"{k} {t[k]}" for k in VIOLATIONS if t[k])
        print(f"  INVARIANTS BROKEN: {broken}")
        print(f"  first failing step: {report['first_failure']}")
    else:
        print("  every invariant held")
    print(f"  seed {report['seed']}; replay: {report['reproduce']}")


def run(args: argparse.Namespace) -> int:
    """Run the soak and print its counts; 1 when an invariant broke."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    code, report = soak(args)
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    return code
