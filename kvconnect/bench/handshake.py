"""Latency of the metadata handshake over loopback, with and without a secret (side channel alone)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time

# Only the stdlib at module level: the CLI imports every bench module just to build its parser.

GOAL_P50_MS = 2.0
GOAL_P99_MS = 10.0
_WARMUP = 20
_NUM_REGIONS = 64  # a realistic reply: one region per layer of a mid-sized model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this bench's options."""
    parser.add_argument("--count", type=int, default=500, help="sequential fetches per configuration")
    parser.add_argument("--timeout", type=float, default=5.0, help="per-fetch timeout in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _percentile(sorted_values: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), without importing numpy.
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _measure(count: int, timeout: float, secret: bytes | None) -> list[float]:
    from kvconnect import wire
    from kvconnect.sidechannel import SideChannelServer, fetch_metadata, metadata_handler

    regions = tuple(
        wire.RegionMeta(
            names=(f"model.layers.{i}.self_attn.attn",),
            base_addr=0x7F00_0000_0000 + i * (1 << 30),
            num_blocks=4096,
            block_bytes=64 * 1024,
            block_stride=64 * 1024,
            device_id=0,
            memory_kind="VRAM",
        )
        for i in range(_NUM_REGIONS)
    )
    compat = wire.Compat(transport="bench", layout="LBHNC", dtype="bfloat16", block_size=16, groups=(
        wire.GroupCompat(label="attention", block_size=16, page_bytes=tuple(r.block_bytes for r in regions),
                         layers=wire.layers_digest([r.names for r in regions])),))
    meta = wire.EngineMetadata(
        engine_id="bench-engine", incarnation=wire.process_incarnation(), rank=0, world_size=1, transport="bench",
        transport_metadata=bytes(4096), regions=regions, group_regions=(tuple(range(len(regions))),), block_size=16,
        layout="LBHNC", dtype="bfloat16", compat=compat)
    expect = meta.compat
    samples: list[float] = []
    with SideChannelServer(metadata_handler(lambda rank: meta), secret=secret) as server:
        for i in range(_WARMUP + count):
            t0 = time.perf_counter()
            fetch_metadata("127.0.0.1", server.port, timeout=timeout, secret=secret, expect=expect)
            if i >= _WARMUP:
                samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def run(args: argparse.Namespace) -> int:
    """Run the bench and print its figures."""
    if args.count < 1:
        raise SystemExit("--count must be at least 1")
    # secret=None falls back to $KVCONNECT_SECRET, which would turn the plain run into an authenticated one.
    saved = os.environ.pop("KVCONNECT_SECRET", None)
    try:
        plain = sorted(_measure(args.count, args.timeout, None))
        auth = sorted(_measure(args.count, args.timeout, secrets.token_bytes(32)))
    finally:
        if saved is not None:
            os.environ["KVCONNECT_SECRET"] = saved

    result = {
        "bench": "handshake",
        "scope": "side channel alone: ZMQ request/reply over loopback, no KV transport",
        "count": args.count,
        "regions": _NUM_REGIONS,
        "p50_ms": round(_percentile(plain, 50), 4),
        "p99_ms": round(_percentile(plain, 99), 4),
        "max_ms": round(plain[-1], 4),
        "p50_ms_auth": round(_percentile(auth, 50), 4),
        "p99_ms_auth": round(_percentile(auth, 99), 4),
        "max_ms_auth": round(auth[-1], 4),
        "goal_p50_ms": GOAL_P50_MS,
        "goal_p99_ms": GOAL_P99_MS,
    }
    result["goal_met"] = (
        max(result["p50_ms"], result["p50_ms_auth"]) < GOAL_P50_MS
        and max(result["p99_ms"], result["p99_ms_auth"]) < GOAL_P99_MS
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"kvconnect handshake: {args.count} sequential fetches on loopback ({result['scope']})")
    print(f"{'':12}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for label, suffix in (("no secret", ""), ("HMAC secret", "_auth")):
        p50, p99, worst = (result[f"{key}_ms{suffix}"] for key in ("p50", "p99", "max"))
        print(f"{label:12}{p50:>10.3f}{p99:>10.3f}{worst:>10.3f}")
    verdict = "met" if result["goal_met"] else "NOT met"
    print(f"goal p50 < {GOAL_P50_MS:g} ms and p99 < {GOAL_P99_MS:g} ms: {verdict}")
    return 0
