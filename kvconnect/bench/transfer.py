"""P/D pull between two processes beside the raw backend and a memcpy of the same bytes, in one run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvconnect.cliargs import UsageError, add_pull_options, positive_int, positive_ints
from kvconnect.progress import bar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvconnect bench transfer`."""
    add_pull_options(parser)
    parser.add_argument("--block-size", type=positive_int, default=None, help="tokens per block (default: the preset's)")
    parser.add_argument("--layout", default="LBHNC", choices=["LBHNC", "BLHNC"],
                        help="attention pages layers outermost, or blocks outermost (one descriptor per block)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (a list with --plot)")
    parser.add_argument("--plot", metavar="FILE.png", help="sweep request sizes and draw GB/s for the three "
                        "(needs the `plot` extra: matplotlib)")
    parser.add_argument("--sweep", type=positive_ints, default="256,1024,4096",
                        help="token counts for --plot, comma-separated")
    tp = parser.add_argument_group("between TP sizes (--prefill-tp and --decode-tp, both given)")
    tp.add_argument("--prefill-tp", type=positive_int, help="prefill ranks (one process each)")
    tp.add_argument("--decode-tp", type=positive_int, help="decode ranks (connectors in this process)")
    tp.add_argument("--mode", choices=["pull", "push"], default="pull",
                    help="push: decode ranks offer, prefill ranks write (measured beside the pull of the same bytes)")


def check_arguments(args: argparse.Namespace) -> None:
    """A pull between TP sizes names both sizes; without them both are 1."""
    if (args.prefill_tp is None) != (args.decode_tp is None):
        given, missing = ("--prefill-tp", "--decode-tp") if args.decode_tp is None else ("--decode-tp", "--prefill-tp")
        raise UsageError(f"{given} needs {missing}: a pull between TP sizes names both (e.g. --prefill-tp 2 "
                         f"--decode-tp 1)")
    if args.prefill_tp is not None and args.plot:
        raise UsageError("--plot sweeps a 1 -> 1 pull; it does not combine with --prefill-tp/--decode-tp")
    if args.mode == "push" and args.prefill_tp is None:
        raise UsageError("--mode push runs between TP sizes: give --prefill-tp and --decode-tp (1 and 1 for equal sizes)")
    args.prefill_tp, args.decode_tp = args.prefill_tp or 1, args.decode_tp or 1


def measure(args: argparse.Namespace, tokens: int, show_progress: bool) -> dict[str, Any]:
    """One run at `tokens` tokens per request: kvconnect, raw backend and memcpy figures."""
    from kvconnect.workload.pull import PullSpec, memcpy_gbps, progress_bar, run_pull

    spec = PullSpec(backend=args.backend, preset=args.preset, tokens=tokens, requests=args.requests,
                    concurrency=args.concurrency, block_table=args.block_table, raw=True, seed=args.seed,
                    block_size=args.block_size, layout=args.layout)
    if show_progress:  # drawn at once: the producer's start and the raw baseline come before the first pull
        progress_bar(0, args.requests)
    r = run_pull(spec, progress=progress_bar if show_progress else None)
    mem = memcpy_gbps(r["bytes_per_request"])
    return {
        **r,
        "kvconnect_gbps": r["gbps"],
        "memcpy_gbps": mem,
        "ratio_vs_memcpy": r["gbps"] / mem if mem else None,
    }


def _table(r: dict[str, Any]) -> None:
    print(f"kvconnect bench transfer: {r['backend']}, {r['preset']} ({r['description']})")
    print(f"  {r['requests']} requests x {r['tokens']} tokens ({r['bytes_per_request'] / 2**20:.1f} MiB each), "
          f"{r['concurrency']} in flight, {r['block_table']} block tables, "
          f"{r['descriptors_per_request']} block descriptors per request")
    print(f"  {'':32s} {'GB/s':>8s} {'kvconnect/x':>12s}")
    print(f"  {'kvconnect P/D pull':32s} {r['kvconnect_gbps']:8.2f} {'':>12s}")
    for label, key in ((f"raw {r['backend']} (1 region, 1 desc)", "raw"),
                       (f"raw {r['backend']} (same descs)", "raw_entries")):
        ratio = r[f"ratio_vs_{key}"]
        print(f"  {label:32s} {r[f'{key}_gbps']:8.2f} {ratio if ratio is not None else float('nan'):12.2f}")
    print(f"  {'memcpy (one process)':32s} {r['memcpy_gbps']:8.2f} {r['ratio_vs_memcpy']:12.2f}")
    if r["raw_gbps"] and r["raw_entries_gbps"]:
        # Where the backend itself slows with the entry count, that, not kvconnect, is the floor.
        print(f"  {r['backend']} alone moves these bytes as {r['descriptors_per_request']} descriptors at "
              f"{r['raw_entries_gbps'] / r['raw_gbps']:.2f} x its one-descriptor speed")
    print(f"  latency p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms; verified: {r['verified']}; "
          f"failed: {len(r['failed'])}")


def _plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["bytes_per_request"] / 2**20 for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("kvconnect_gbps", "kvconnect P/D pull"), ("raw_gbps", f"raw {results[0]['backend']}"),
                       ("memcpy_gbps", "memcpy")):
        ax.plot(sizes, [r[key] for r in results], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{results[0]['backend']}, {results[0]['preset']}: GB/s against request size")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_tp(args: argparse.Namespace) -> int:
    """Pull (and with --mode push, push) between TP sizes beside the same bytes 1 -> 1 and the backend posting
    the same descriptors."""
    from kvconnect.workload.tp import TPSpec, descriptor_build_ms, run_tp_pull

    spec = TPSpec(backend=args.backend, preset=args.preset, tokens=args.tokens, requests=args.requests,
                  prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, seed=args.seed)
    push = args.mode == "push"
    steps = 4 if push else 3  # (push,) across TP sizes, 1 -> 1, descriptor build
    draw = None if args.json else bar("runs")

    def step(done: int) -> None:
        if draw:
            draw(done, steps)

    step(0)
    pushed = run_tp_pull(TPSpec(**{**spec.__dict__, "mode": "push"})) if push else None
    step(steps - 3)
    tp = run_tp_pull(spec)
    step(steps - 2)
    same = run_tp_pull(TPSpec(**{**spec.__dict__, "prefill_tp": 1, "decode_tp": 1}))
    step(steps - 1)
    build_ms, rows = descriptor_build_ms()
    step(steps)
    result = {**tp, "backend": args.backend, "preset": args.preset, "tokens": args.tokens,
              "one_to_one_gbps": same["gbps"], "ratio_vs_one_to_one": tp["gbps"] / same["gbps"],
              "ratio_vs_backend": tp["gbps"] / tp["backend_gbps"] if tp["backend_gbps"] else None,
              "descriptor_build_ms_131072_blocks": build_ms, "descriptor_rows": rows,
              "verified": tp["verified"] and same["verified"] and (pushed is None or pushed["verified"])}
    failed = tp["failed"] + same["failed"]
    if pushed is not None:
        failed += pushed["failed"]
        result.update(mode="push", push_gbps=pushed["gbps"], push_ratio_vs_pull=pushed["gbps"] / tp["gbps"],
                      push_ratio_vs_backend=pushed["gbps"] / tp["backend_gbps"] if tp["backend_gbps"] else None)
    if args.json:
        print(json.dumps(result))
        return 0 if result["verified"] else 1
    print(f"kvconnect bench transfer: {args.backend}, {args.preset}, prefill TP {args.prefill_tp} -> decode TP "
          f"{args.decode_tp}, {args.requests} requests x {args.tokens} tokens "
          f"({tp['bytes_per_request'] / 2**20:.1f} MiB each, medians)")
    print(f"  {'':40s} {'GB/s':>8s} {'kvconnect/x':>12s}")
    if pushed is not None:
        print(f"  {'kvconnect P/D push across TP sizes':40s} {pushed['gbps']:8.2f}   (offers to last load; "
              f"{result['push_ratio_vs_pull']:.2f} x the pull below)")
    print(f"  {'kvconnect P/D pull across TP sizes':40s} {tp['gbps']:8.2f}")
    print(f"  {'kvconnect P/D pull, same bytes 1 -> 1':40s} {same['gbps']:8.2f} {result['ratio_vs_one_to_one']:12.2f}")
    if tp["backend_gbps"]:
        print(f"  {args.backend + ' posting the pull descriptors':40s} {tp['backend_gbps']:8.2f} "
              f"{result['ratio_vs_backend']:12.2f}")
    print(f"  descriptors of a 2 -> 1 head split of 131072 blocks: {rows} rows in {build_ms:.2f} ms")
    print(f"  verified: {result['verified']}; failed: {failed}")
    return 0 if result["verified"] else 1


def run(args: argparse.Namespace) -> int:
    """Measure, print, optionally plot; exit status 1 if any byte differed or any request failed."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.prefill_tp != 1 or args.decode_tp != 1 or args.mode == "push":
        return run_tp(args)
    if args.plot:
        import matplotlib  # noqa: F401  (missing: exit 3 with the install hint, before the sweep runs)

        results = [measure(args, t, show_progress=not args.json) for t in args.sweep]
        _plot(results, args.plot)
        if args.json:
            print(json.dumps(results))
        else:
            for r in results:
                _table(r)
            print(f"plot written to {args.plot}", file=sys.stderr)
    else:
        results = [measure(args, args.tokens, show_progress=not args.json)]
        if args.json:
            print(json.dumps(results[0]))
        else:
            _table(results[0])
    return 0 if all(r["verified"] and not r["failed"] for r in results) else 1
