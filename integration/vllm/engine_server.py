"""One vLLM engine in this process, driven by JSON lines on stdin; answers one JSON line per command.

Run by the e2e tests and compare.py in a new session (so the whole process group can be killed).
argv[1] is a JSON object: model, kv (KVTransferConfig fields or null), and LLM keyword arguments.
Commands: {"op": "generate", "prompts": [[ids]...], "max_tokens": n, "params": [kv params|null...]},
{"op": "reset_prefix_cache"}, {"op": "ping"}, {"op": "quit"}. Replies carry "ok" and results.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = spec.get("kv")
    kwargs = dict(spec.get("llm", {}))
    if kv is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, **kwargs)
    out = sys.__stdout__
    print(json.dumps({"ok": True, "ready": True}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "quit":
                print(json.dumps({"ok": True}), file=out, flush=True)
                break
            if op == "ping":
                reply = {"ok": True}
            elif op == "reset_prefix_cache":
                reply = {"ok": True, "reset": bool(llm.reset_prefix_cache())}
            elif op == "generate":
                prompts = cmd["prompts"]
                params = cmd.get("params") or [None] * len(prompts)
                sps = []
                for p in params:
                    extra = {"kv_transfer_params": p} if p is not None else None
                    sps.append(SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8),
                                              ignore_eos=True, detokenize=False, extra_args=extra))
                t0 = time.perf_counter()
                res = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sps, use_tqdm=False)
                wall = time.perf_counter() - t0
                reply = {"ok": True, "wall_s": wall, "outputs": [
                    {"token_ids": list(r.outputs[0].token_ids), "finish_reason": r.outputs[0].finish_reason,
                     "kv_transfer_params": r.kv_transfer_params} for r in res]}
            else:
                reply = {"ok": False, "error": f"unknown op {op}"}
        except Exception as exc:  # report, keep serving
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
