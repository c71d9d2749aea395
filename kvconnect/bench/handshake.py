"""Latency of the metadata handshake over loopback, with and without a secret, beside a raw ZMQ round trip.

The baseline, measured in the same run, is a bare ZMQ REQ/REP exchange over loopback carrying the same
number of bytes each way: what is left is kvconnect's own cost (encoding, validation, authentication).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time

from kvconnect.cliargs import positive_float, positive_int

_WARMUP = 20
_NUM_REGIONS = 64  # a realistic reply: one region per layer of a mid-sized model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this bench's options."""
    parser.add_argument("--count", type=positive_int, default=500, help="sequential fetches per configuration")
    parser.add_argument("--timeout", type=positive_float, default=5.0, help="per-fetch timeout in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _percentile(sorted_values: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), without importing numpy.
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _measure_raw(count: int, request_bytes: int, reply_bytes: int) -> list[float]:
    """Bare ZMQ REQ/REP exchanges over loopback, each on a new connection, moving a handshake's bytes."""
    import threading

    import zmq

    ctx = zmq.Context()
    rep_sock = ctx.socket(zmq.REP)
    port = rep_sock.bind_to_random_port("tcp://127.0.0.1")
    reply = bytes(reply_bytes)

    def serve() -> None:
        for _ in range(_WARMUP + count):
            rep_sock.recv()
            rep_sock.send(reply)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    request = bytes(request_bytes)
    samples: list[float] = []
    try:
        for i in range(_WARMUP + count):
            # Like a handshake: a fresh connection per exchange, on a context made once.
            t0 = time.perf_counter()
            req = ctx.socket(zmq.REQ)
            req.connect(f"tcp://127.0.0.1:{port}")
            req.send(request)
            req.recv()
            req.close(linger=0)
            if i >= _WARMUP:
                samples.append((time.perf_counter() - t0) * 1e3)
    finally:
        server.join(timeout=5)
        rep_sock.close(linger=0)
        ctx.term()
    return samples


def _metadata():
    """A realistic metadata reply: one region per layer of a mid-sized model."""
    from kvconnect import wire
    from kvconnect.compat import layers_digest

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
                         layers=layers_digest([r.names for r in regions])),))
    return wire.EngineMetadata(
        engine_id="bench-engine", incarnation=wire.process_incarnation(), rank=0, world_size=1, transport="bench",
        transport_metadata=bytes(4096), regions=regions, group_regions=(tuple(range(len(regions))),), block_size=16,
        layout="LBHNC", dtype="bfloat16", compat=compat)


def _measure(count: int, timeout: float, secret: bytes | None) -> list[float]:
    from kvconnect.sidechannel import SideChannelServer, fetch_metadata, metadata_handler

    meta = _metadata()
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
    # secret=None falls back to $KVCONNECT_SECRET, which would turn the plain run into an authenticated one.
    saved = os.environ.pop("KVCONNECT_SECRET", None)
    try:
        plain = sorted(_measure(args.count, args.timeout, None))
        auth = sorted(_measure(args.count, args.timeout, secrets.token_bytes(32)))
    finally:
        if saved is not None:
            os.environ["KVCONNECT_SECRET"] = saved
    from kvconnect import wire

    reply_bytes = len(wire.METADATA.encode(_metadata()))
    raw = sorted(_measure_raw(args.count, 128, reply_bytes))

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
        "reply_bytes": reply_bytes,
        "p50_ms_raw_zmq": round(_percentile(raw, 50), 4),
        "p99_ms_raw_zmq": round(_percentile(raw, 99), 4),
        "max_ms_raw_zmq": round(raw[-1], 4),
    }
    for suffix in ("", "_auth"):
        result[f"p50_ratio_vs_raw{suffix}"] = round(result[f"p50_ms{suffix}"] / result["p50_ms_raw_zmq"], 3)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"kvconnect handshake: {args.count} sequential fetches on loopback ({result['scope']})")
    print(f"{'':14}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'p50 / raw':>11}")
    for label, suffix in (("no secret", ""), ("HMAC secret", "_auth"), ("raw ZMQ", "_raw_zmq")):
        p50, p99, worst = (result[f"{key}_ms{suffix}"] for key in ("p50", "p99", "max"))
        ratio = result.get(f"p50_ratio_vs_raw{suffix}", 1.0)
        print(f"{label:14}{p50:>10.3f}{p99:>10.3f}{worst:>10.3f}{ratio:>11.2f}")
    print(f"  raw ZMQ: a bare REQ/REP exchange on a new loopback connection carrying the same {reply_bytes}-byte reply")
    return 0
