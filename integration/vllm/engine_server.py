"""One vLLM engine in this process, driven by JSON lines on stdin; answers one JSON line per command.

Run by the e2e tests and compare.py in a new session (so the whole process group can be killed).
argv[1] is a JSON object: model, kv (KVTransferConfig fields or null), and LLM keyword arguments.
Commands: {"op": "generate", "prompts": [[ids]...], "max_tokens": n, "params": [kv params|null...]},
{"op": "run", ... "abort": [indices], "abort_after_s": s | "abort_at_first_token": true |
"abort_when": path} (generate, aborting some requests on the way; "aborted_mark": path is created
once all of them are aborted; "stagger_steps": k adds request i after i*k engine steps; "ids" names
the requests; each output says when its request was added, when its first token came and when
it finished, in unix seconds), {"op": "reset_prefix_cache"}, {"op": "ping"}, {"op": "quit"}.
Replies carry "ok" and results.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback

_runs = itertools.count()


def sampling(cmd: dict, p: dict | None):
    """Greedy sampling params for one prompt, carrying its kv_transfer_params."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": p} if p is not None else None
    return SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True,
                          detokenize=False, extra_args=extra, logprobs=cmd.get("logprobs"))


def top_logprobs(output) -> list[dict[str, float]] | None:
    """Per generated position, the top logprobs as {token id: logprob} (None when not asked for)."""
    if output.logprobs is None:
        return None
    return [{str(t): lp.logprob for t, lp in pos.items()} for pos in output.logprobs]


def _abort_due(cmd: dict, now: float) -> bool:
    """Whether the run's doomed requests are due to be aborted, `now` seconds into it."""
    if "abort_when" in cmd:  # a file another process creates (pause.py's "paused")
        return os.path.exists(cmd["abort_when"])
    return "abort_after_s" in cmd and now >= cmd["abort_after_s"]


def _await_output_or_abort(engine, due, deadline: float) -> list[str]:
    """Wait until the engine core has output for a step, or `due()` names requests to abort (returned).

    `engine.step()` blocks until the engine core sends output, and it sends none while its requests only
    wait for KV from a connector; the check must not wait behind it. (vLLM's client keeps what its
    engine core sent in `outputs_queue`; an in-process core, which has none, is stepped at once.)
    """
    sent = getattr(engine.engine_core, "outputs_queue", None)
    while True:
        doomed = due()
        if doomed or sent is None or not sent.empty() or time.perf_counter() >= deadline:
            return doomed
        time.sleep(0.001)


def run_with_aborts(llm, cmd: dict) -> dict:
    """Add the prompts as requests (all at once, or staggered by engine steps), abort the chosen ones
    (after a delay or at their first token), step until the others finish; aborted requests report
    finish_reason "aborted"."""
    engine = llm.llm_engine
    prompts = cmd["prompts"]
    params = cmd.get("params") or [None] * len(prompts)
    run = next(_runs)
    # Outputs carry these; aborts take the engine's own. "ids" names them (vLLM's push pairs by request id).
    ids = cmd.get("ids") or [f"run{run}-{i}" for i in range(len(prompts))]
    stagger = cmd.get("stagger_steps", 0)
    waiting = list(zip(ids, prompts, params))
    internal: dict[str, str] = {}
    external: dict[str, str] = {}
    doomed = {ids[i] for i in cmd.get("abort", [])}
    done: dict[str, dict] = {}
    added_at: dict[str, float] = {}  # unix times, comparable across the engines of one host
    first_at: dict[str, float] = {}
    t0 = time.perf_counter()
    deadline = t0 + cmd.get("timeout_s", 300)
    steps = 0
    while len(done) < len(ids) and time.perf_counter() < deadline:
        while waiting and steps >= len(internal) * stagger:
            rid, tokens, p = waiting.pop(0)
            internal[rid] = engine.add_request(rid, {"prompt_token_ids": tokens}, sampling(cmd, p))
            external[internal[rid]] = rid
            added_at[rid] = time.time()
        due = _await_output_or_abort(engine, lambda: [
            r for r in doomed if r in internal and r not in done and _abort_due(cmd, time.perf_counter() - t0)],
            deadline)
        steps += not due
        for out in ([] if due else engine.step()):
            out.request_id = external.get(out.request_id, out.request_id)
            if out.outputs[0].token_ids and out.request_id not in first_at:
                first_at[out.request_id] = time.time()
            if out.request_id in doomed and cmd.get("abort_at_first_token") and out.outputs[0].token_ids:
                due.append(out.request_id)
            elif out.finished:
                done[out.request_id] = {"token_ids": list(out.outputs[0].token_ids),
                                        "finish_reason": out.outputs[0].finish_reason,
                                        "logprobs": top_logprobs(out.outputs[0]),
                                        "added_at": added_at.get(out.request_id),
                                        "first_token_at": first_at.get(out.request_id),
                                        "finished_at": time.time()}
        if due:
            engine.abort_request(sorted({internal[r] for r in due}), internal=True)
            for r in due:
                done[r] = {"token_ids": [], "finish_reason": "aborted"}
            if "aborted_mark" in cmd and doomed <= done.keys():
                open(cmd["aborted_mark"], "w").close()
    return {"ok": len(done) == len(ids), "wall_s": time.perf_counter() - t0,
            "outputs": [done.get(r, {"token_ids": [], "finish_reason": "timeout"}) for r in ids]}


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM
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
            elif op == "run":
                reply = run_with_aborts(llm, cmd)
            elif op == "generate":
                prompts = cmd["prompts"]
                params = cmd.get("params") or [None] * len(prompts)
                sps = [sampling(cmd, p) for p in params]
                t0 = time.perf_counter()
                res = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sps, use_tqdm=False)
                wall = time.perf_counter() - t0
                reply = {"ok": True, "wall_s": wall, "finished_at": time.time(), "outputs": [
                    {"token_ids": list(r.outputs[0].token_ids), "finish_reason": r.outputs[0].finish_reason,
                     "kv_transfer_params": r.kv_transfer_params, "logprobs": top_logprobs(r.outputs[0])}
                    for r in res]}
            else:
                reply = {"ok": False, "error": f"unknown op {op}"}
        except Exception as exc:  # report, keep serving
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
