"""Time to first token through SGLang's router: kvconnect's transfer backends against SGLang's own Mooncake backend.

Starts one prefill + decode set per backend (one set at a time, the harness's tiny random Llama and CPU
flags), sends every set the same prompts one request at a time (streaming, greedy), and prints per
backend and prompt length the median time to first token seen by the client and the median decode-side
wait (SGLang's per-request `transfer_duration` on the decode: from its destination pages sent to the
prefill until the pages and the first token arrived; it includes the prefill's compute), each with its
ratio to the baseline's. `--cycles N` starts every backend's set N times, in turn and in alternating
order (A B C, then C B A, ...), and pools the rounds: a set's compute speed differs from the next set's
by several percent on a shared 2-core host, and a drift over the run would otherwise favour whichever
backend runs first; each set's own median is printed too. The prefill runs on core 0 and the decode on
core 1, one OpenMP thread each (`--no-pin`: both share every core, where the decode's scheduler, which
spins while it waits, takes CPU from the prefill's forward). `--model kv-heavy` uses a model with 8 times
the KV per token of the e2e model, so that the transfer is a larger share of the wait. Both Mooncake
backends run Mooncake over TCP. `--backends ...,nixl` adds SGLang's own NIXL backend, kvconnect-nixl's
like-for-like baseline (not run by default: on these hosts it takes several times as long): it runs
unchanged but for the memory kind its agent gives NIXL (VRAM, which NIXL refuses for host memory; the
CPU shim makes it DRAM, see cpu_shim/sglang_cpu_shim/plugin.py). A backend whose tokens differ from the baseline's for the same prompt,
or a failed request, makes the run fail (exit 1): a time is only worth reporting for a transfer that
delivered the right pages.

    .venv-sglang/bin/python integration/sglang/ttft_vs_mooncake.py [--rounds 5] [--lengths 64,512,1500]
        [--model tiny|kv-heavy] [--cycles 1] [--no-pin]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from harness import KV_HEAVY, REQUEST_S, TINY, PDSet, make_model, prompts_of

BASELINE = "mooncake"
# SGLang's Mooncake backend defaults to RDMA; kvconnect's Mooncake transport runs TCP unless told otherwise.
ENV = {"MOONCAKE_PROTOCOL": "tcp"}
# Per-request stage times in the servers' logs (the decode's `transfer_duration`).
FLAGS = ["--enable-request-time-stats-logging"]
_STATS = re.compile(r"ReqTimeStats\(rid=(\S+?),.*type=decode\).*?transfer_duration=([0-9.]+)ms")
SHAPES = {"tiny": TINY, "kv-heavy": KV_HEAVY}


def stream_ttft(url: str, rid: str, ids: list[int], max_new_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first streamed token, all output ids) of one streaming greedy /generate."""
    u = urlparse(url)
    body = json.dumps({"input_ids": ids, "rid": rid, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}).encode()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=REQUEST_S)
    deadline = time.monotonic() + REQUEST_S
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{rid}: HTTP {resp.status}: {resp.read(300)!r}")
        first, out = None, None
        while time.monotonic() < deadline:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            chunk = json.loads(line[5:])
            finish = (chunk.get("meta_info") or {}).get("finish_reason") or {}
            if "error" in chunk or finish.get("type") == "abort":
                raise RuntimeError(f"{rid}: {str(chunk)[:300]}")
            out = chunk.get("output_ids", out)
        if first is None or out is None or len(out) != max_new_tokens:
            raise RuntimeError(f"{rid}: stream ended without {max_new_tokens} tokens (got {out})")
        return first, out
    finally:
        conn.close()


def decode_waits(log: Path) -> dict[str, float]:
    """rid -> the decode's `transfer_duration` in seconds, from a decode server's log."""
    return {m[1]: float(m[2]) / 1e3 for m in _STATS.finditer(log.read_text(errors="replace"))}


def run_backend(backend: str, model: Path, logdir: Path, prompts: dict[int, list[list[int]]], warmup: int,
                max_new_tokens: int, tag: str = "",
                pin: bool = True) -> dict[int, list[tuple[str, float, list[int]]]]:
    """Per prompt length: (rid, TTFT, output ids) per timed round, from one P/D set started and stopped here
    (`tag`: this set's prefix for its logs and request ids; `pin`: prefill on core 0, decode on core 1)."""
    pd = PDSet(model, logdir, backend, env=ENV, extra=FLAGS, tag=tag, cores=(0, 1) if pin else None)
    try:
        # Warm-up: the first requests of a set open connections and handshakes; they are not timed.
        for n in prompts:
            for i in range(warmup):
                stream_ttft(pd.url, f"warm-{tag}{backend}-{n}-{i}", prompts_of([n], seed=10_000 + i)[0],
                            max_new_tokens)
        out: dict[int, list] = {n: [] for n in prompts}
        for r in range(max(len(v) for v in prompts.values())):
            for n, rounds in prompts.items():  # lengths interleaved, so drift over the run hits each alike
                rid = f"bench-{tag}{backend}-{n}-{r}"
                out[n].append((rid, *stream_ttft(pd.url, rid, rounds[r], max_new_tokens)))
        time.sleep(2)  # the decode logs a request's stage times as it finishes; let the last line land
    finally:
        pd.stop()
    return out


def median_ms(xs: list[float]) -> str:
    """The median of seconds `xs` in milliseconds, as printed ("-" when there are none)."""
    return f"{statistics.median(xs) * 1e3:.1f}" if xs else "-"


def table(results: dict[str, dict], waits: dict[str, dict[str, float]], lengths: list[int]) -> list[str]:
    """The printed rows: backend, prompt length, median TTFT and decode wait, and their ratios to the baseline."""
    head = f"{'backend':<20} {'tokens':>6} {'TTFT ms':>9} {'min-max ms':>15} {'ratio':>6} {'decode wait ms':>15} {'ratio':>6}"
    rows = [head, "-" * len(head)]
    base_t = {n: statistics.median(t for _, t, _ in results[BASELINE][n]) for n in lengths}
    base_w = {n: [waits[BASELINE][rid] for rid, _, _ in results[BASELINE][n] if rid in waits[BASELINE]]
              for n in lengths}
    for backend, per_len in results.items():
        for n in lengths:
            ts = [t for _, t, _ in per_len[n]]
            ws = [waits[backend][rid] for rid, _, _ in per_len[n] if rid in waits[backend]]
            ratio = "" if backend == BASELINE else f"{statistics.median(ts) / base_t[n]:.2f}"
            wratio = "" if backend == BASELINE or not ws or not base_w[n] else \
                f"{statistics.median(ws) / statistics.median(base_w[n]):.2f}"
            rows.append(f"{backend:<20} {n:>6} {median_ms(ts):>9} {min(ts) * 1e3:>7.1f}-{max(ts) * 1e3:<7.1f} "
                        f"{ratio:>6} {median_ms(ws):>15} {wratio:>6}")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every backend's set in turn and print the table; 1 if a request failed or tokens differ."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default=f"{BASELINE},kvconnect-mooncake,kvconnect-nixl",
                    help=f"comma-separated; {BASELINE} (the baseline) is always run")
    ap.add_argument("--lengths", default="64,512,1500", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="timed requests per length and backend")
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests per length before the rounds")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvconnect-sglang-bench"))
    ap.add_argument("--cycles", type=int, default=1,
                    help="sets per backend, started in turn in alternating order; their rounds are pooled")
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny",
                    help="tiny: the e2e model; kv-heavy: 8 times its KV per token")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let the servers share every core (default: prefill on core 0, decode on core 1, one "
                         "OpenMP thread each)")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    backends = [BASELINE] + [b for b in a.backends.split(",") if b and b != BASELINE]
    if a.cycles < 1 or a.rounds < 1 or a.warmup < 0 or min(lengths) < 1 or max(lengths) > 1900:
        ap.error("cycles >= 1, rounds >= 1, warmup >= 0, lengths 1..1900 (the model's context is 2048)")
    # SIGTERM (make interrupted, a job killed) unwinds through the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda sig, _f: sys.exit(128 + sig))
    a.workdir.mkdir(parents=True, exist_ok=True)
    logdir = a.workdir / "logs"
    logdir.mkdir(exist_ok=True)
    model = make_model(a.workdir / f"{a.model}-llama", SHAPES[a.model])
    # The same prompts for every backend, a fresh one per round (no prefix-cache hit on the prefill).
    prompts = {n: prompts_of([n] * a.rounds, seed=n) for n in lengths}
    results: dict[str, dict[int, list]] = {b: {n: [] for n in lengths} for b in backends}
    waits: dict[str, dict[str, float]] = {b: {} for b in backends}
    for cycle in range(a.cycles):
        tag = f"c{cycle}-" if a.cycles > 1 else ""
        for backend in backends if cycle % 2 == 0 else backends[::-1]:
            t = time.monotonic()
            try:
                got = run_backend(backend, model, logdir, prompts, a.warmup, a.max_new_tokens, tag, a.pin)
            except (RuntimeError, OSError) as exc:  # a server that did not start, a failed or timed-out request
                print(f"FAIL: {backend}: {exc}\nlogs: {logdir}")
                return 1
            for n in lengths:
                results[backend][n].extend(got[n])
            waits[backend].update(decode_waits(logdir / f"decode-{tag}{backend}.log"))
            per_set = ", ".join(f"{n} tokens {median_ms([x for _, x, _ in got[n]])} ms" for n in lengths)
            print(f"{tag}{backend}: set started, measured and stopped in {time.monotonic() - t:.0f} s; "
                  f"median TTFT {per_set}", flush=True)
    bad = [f"{b} {n} tokens, round {r}" for b in backends for n in lengths for r in range(a.rounds * a.cycles)
           if results[b][n][r][2] != results[BASELINE][n][r][2]]
    sets = f"{a.cycles} sets per backend in alternating order, " if a.cycles > 1 else ""
    print(f"\n{sets}{a.rounds} timed rounds per set and length (after {a.warmup} warm-up requests per length), "
          f"one request at a time, {a.max_new_tokens} new tokens, greedy; medians; ratio = backend / {BASELINE}; "
          f"model {a.model}")
    print("TTFT: client-side, through sglang_router --mini-lb, streaming. decode wait: the decode's "
          "transfer_duration (pages offered to the prefill until KV and first token arrived)")
    print("\n".join(table(results, waits, lengths)))
    print(f"logs: {logdir}")
    if bad:
        print(f"FAIL: output tokens differ from {BASELINE}'s: {', '.join(bad)}")
        return 1
    print(f"output tokens equal {BASELINE}'s for every prompt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
