"""Loads from a healthy producer while another producer is stopped, beside the same loads with none stopped."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import time
from typing import Any

from kvconnect.cliargs import positive_int
from kvconnect.progress import bar

PIPE_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvconnect bench isolation`."""
    parser.add_argument("--backend", default="nixl", choices=["nixl", "mooncake"])
    parser.add_argument("--loads", type=positive_int, default=8, help="loads queued to the healthy producer per round")
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds of each kind; percentiles cover all loads")
    parser.add_argument("--blocks", type=positive_int, default=16, help="blocks per load (64 KiB each)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _producer(conn: Any, backend: str, engine_id: str, num_blocks: int) -> None:
    import torch

    from kvconnect.connector import ConnectorConfig, KVConnector

    caches = {"kv": torch.zeros(num_blocks, 65536, dtype=torch.uint8)}
    c = KVConnector(ConnectorConfig(role="producer", backend=backend, engine_id=engine_id, lease_s=600))
    try:
        c.register_kv_caches(caches)
        conn.send(os.getpid())
        while (cmd := conn.recv()) is not None:
            rid, ids = cmd
            conn.send(msgspec_builtins(c.request_finished(rid, [ids], len(ids) * 16)))
            c.get_finished()
    finally:
        c.close()


def msgspec_builtins(params: Any) -> dict:
    from kvconnect import wire

    return wire.transfer_params_to_builtins(params)


def _start(backend: str, engine_id: str, num_blocks: int) -> tuple[mp.Process, Any, int]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, backend, engine_id, num_blocks), daemon=True)
    proc.start()
    if not parent.poll(PIPE_TIMEOUT_S):
        raise RuntimeError(f"producer {engine_id} did not start")
    return proc, parent, parent.recv()


def _hold(pipe: Any, rid: str, ids: list[int]) -> dict:
    pipe.send((rid, ids))
    if not pipe.poll(PIPE_TIMEOUT_S):
        raise RuntimeError("producer did not answer")
    return pipe.recv()


def _round(consumer: Any, healthy: Any, stuck: dict | None, args: argparse.Namespace, tag: str) -> list[float]:
    """Queue (optionally) one load to the stopped producer first, then `loads` to the healthy one."""
    if stuck is not None:
        consumer.start_load(stuck, [[0]])
    params = [_hold(healthy, f"{tag}-{i}", list(range(i * args.blocks, (i + 1) * args.blocks)))
              for i in range(args.loads)]
    started, done = {}, {}
    for i, p in enumerate(params):
        started[p["request_id"]] = time.perf_counter()
        consumer.start_load(p, [list(range(1 + i * args.blocks, 1 + (i + 1) * args.blocks))])
    while len(done) < args.loads:
        fin = consumer.get_finished()
        for rid in fin.loaded:
            if rid in started:
                done[rid] = time.perf_counter() - started[rid]
        if any(rid in started for rid in fin.failed):
            raise RuntimeError(f"a healthy load failed: {fin.failed}")
        time.sleep(0.0002)
    return list(done.values())


def _drain(consumer: Any) -> None:
    """Wait (bounded) until every load has been reported, the resumed producer's included."""
    deadline = time.monotonic() + PIPE_TIMEOUT_S
    while consumer.consumer.pending and time.monotonic() < deadline:
        consumer.get_finished()
        time.sleep(0.001)


def run(args: argparse.Namespace) -> int:
    """Measure both kinds of round and print the healthy loads' p50/p99 for each."""
    import numpy as np

    from kvconnect.connector import ConnectorConfig, KVConnector

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # The two producers' start and the warm-up take seconds before the first round: they are steps too.
    draw, steps = (None if args.json else bar("producers, warm-up, rounds")), args.rounds + 3

    def step(done: int) -> None:
        if draw:
            draw(done, steps)

    step(0)
    num_blocks = args.loads * args.blocks + 1
    healthy_proc, healthy, _ = _start(args.backend, "healthy", num_blocks)
    step(1)
    stuck_proc, stuck, stuck_pid = _start(args.backend, "stopped", 4)  # blocks 0..3; the consumer reads into 0
    step(2)
    import torch

    consumer = KVConnector(ConnectorConfig(role="consumer", backend=args.backend, engine_id="bench-decode",
                                           load_timeout_s=600, handshake_timeout_s=300))
    consumer.register_kv_caches({"kv": torch.zeros(num_blocks, 65536, dtype=torch.uint8)})
    results: dict[str, list[float]] = {"alone": [], "beside_stopped": []}
    try:
        _round(consumer, healthy, None, args, "warm-up")
        for r in range(args.rounds):
            step(3 + r)
            results["alone"] += _round(consumer, healthy, None, args, f"alone{r}")
            held = _hold(stuck, f"stuck{r}", [r % 4])  # held before the producer stops: it cannot answer after
            os.kill(stuck_pid, signal.SIGSTOP)
            try:
                results["beside_stopped"] += _round(consumer, healthy, held, args, f"beside{r}")
            finally:
                os.kill(stuck_pid, signal.SIGCONT)
            _drain(consumer)
        step(steps)
    finally:
        consumer.close()
        for pipe, proc in ((healthy, healthy_proc), (stuck, stuck_proc)):
            pipe.send(None)
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    out: dict[str, Any] = {"backend": args.backend, "loads_per_round": args.loads, "rounds": args.rounds,
                           "bytes_per_load": args.blocks * 65536}
    for kind, lat in results.items():
        ms = np.array(lat) * 1e3
        out[f"{kind}_p50_ms"], out[f"{kind}_p99_ms"] = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
    out["p50_ratio"] = out["beside_stopped_p50_ms"] / out["alone_p50_ms"]
    out["p99_ratio"] = out["beside_stopped_p99_ms"] / out["alone_p99_ms"]
    if args.json:
        print(json.dumps(out))
    else:
        print(f"kvconnect bench isolation: {args.backend}, {args.loads} loads of {args.blocks * 64} KiB per round, "
              f"{args.rounds} rounds")
        for kind in results:
            print(f"  {kind:16s} p50 {out[f'{kind}_p50_ms']:8.2f} ms   p99 {out[f'{kind}_p99_ms']:8.2f} ms")
        print(f"  beside a stopped producer / alone: p50 x{out['p50_ratio']:.2f}, p99 x{out['p99_ratio']:.2f}")
    return 0
