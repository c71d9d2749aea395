"""Time to first token through `kvconnect proxy`, pull against push, with real vLLM OpenAI servers.

The README's P/D commands (prefill server on core 0, decode server on core 1, `KVConnectNixl`, both
with `mode: push` so that they take both routers' requests), the README's pull router and push router
in front of them. Per prompt length and round, a fresh random text prompt (one token per byte) is
streamed through each path and timed from the client's send to the first streamed chunk:
- plain: straight to the decode server (it computes the prompt itself), the baseline;
- pull: `kvconnect proxy` (prefill, then decode pulls the KV);
- push: `kvconnect proxy --mode push` (both at once; prefill writes into decode's blocks);
- push+lw: the same router in front of a second prefill server that streams layer by layer.
Each round starts at another path and waits `--settle-s` before each request. Prints the medians and
the ratios to pull.

    .venv-vllm/bin/python integration/vllm/proxy_ttft.py --lengths 1000 4000 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness import add_tokenizer, make_llama
from test_proxy_e2e import Server, _free_port, _with, readme_pd_commands, vllm_server

MODES = ("plain", "pull", "push", "push+lw")


def first_chunk_s(base: str, prompt: str) -> float:
    """Seconds from sending a streamed completion to its first chunk with a token."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: {r.status_code} {r.read()!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError(f"{base}: no token streamed")


def router(name: str, cmd: list[str], prefill: Server, decode: Server) -> Server:
    port = _free_port()
    argv = _with(_with([sys.executable, "-m", "kvconnect.cli", *cmd[1:]], "--prefill", prefill.url), "--decode", decode.url)
    return Server(name, argv + ["--port", str(port), "--request-timeout-s", "300"], dict(os.environ),
                  f"http://127.0.0.1:{port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause before each timed request")
    args = ap.parse_args()
    big = ("--max-model-len", "4300", "--max-num-batched-tokens", "4300")
    with tempfile.TemporaryDirectory() as tmp:
        model = add_tokenizer(make_llama(Path(tmp) / "llama", hidden=args.hidden, layers=args.layers,
                                         heads=max(4, args.hidden // 64), kv_heads=max(4, args.hidden // 64),
                                         intermediate=2 * args.hidden, max_pos=4400))
        prefill_cmd, decode_cmd, pull_cmd, push_cmd = readme_pd_commands()
        servers = [vllm_server("ttft-proxy-prefill", prefill_cmd, model, 0, {"mode": "push"}, big, eager=False),
                   vllm_server("ttft-proxy-prefill-lw", prefill_cmd, model, 0, {"mode": "push", "layerwise": True}, big,
                               eager=False),
                   vllm_server("ttft-proxy-decode", decode_cmd, model, 1, {"mode": "push", "load_timeout_s": 60.0}, big,
                               eager=False)]
        routers: list[Server] = []
        try:
            for s in servers:
                s.wait_healthy(420)
            P, PL, D = servers
            routers = [router("ttft-pull-router", pull_cmd, P, D), router("ttft-push-router", push_cmd, P, D),
                       router("ttft-push-lw-router", push_cmd, PL, D)]
            for r in routers:
                r.wait_healthy(60)
            paths = dict(zip(MODES, [D.url] + [r.url for r in routers]))
            rng = random.Random(0)
            text = lambda n: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))  # noqa: E731
            for base in paths.values():  # first handshakes and allocations out of the timings
                first_chunk_s(base, text(64))
            times: dict[tuple[int, str], list[float]] = {}
            for n in args.lengths:
                for r in range(args.rounds):
                    prompt = text(n)
                    # Each round starts at another path, so that none always runs after the same one, and
                    # each request waits until the last one's blocks are free (its delayed frees done).
                    for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                        time.sleep(args.settle_s)
                        times.setdefault((n, mode), []).append(first_chunk_s(paths[mode], prompt))
        finally:
            for s in routers + servers:
                s.close()
    print(f"time to first streamed token through kvconnect proxy, medians of {args.rounds} rounds, seconds")
    print(f"{'tokens':>6} {'mode':>8} {'ttft':>7}   ratio to pull")
    for n in args.lengths:
        pull = statistics.median(times[(n, "pull")])
        for mode in MODES:
            med = statistics.median(times[(n, mode)])
            print(f"{n:>6} {mode:>8} {med:7.3f}" + (f"   {med / pull:.2f}x" if mode.startswith("push") else ""))


if __name__ == "__main__":
    main()
