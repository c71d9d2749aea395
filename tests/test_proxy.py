"""`kvconnect proxy` against small fake vLLM instances served over real HTTP on loopback.

The fakes answer like vLLM's OpenAI server does for P/D: prefill returns `kv_transfer_params`, decode
answers (or streams) with whatever params it was given echoed back, so every test can see exactly
what each instance received. Faults (refused connections, 5xx, hangs, streams cut off) are the fakes'
own behaviour; the router under test is the real app on a real socket.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvconnect.proxy.app import ProxyConfig, create_app
from kvconnect.proxy.pool import NoInstanceError, Pool, normalise_url

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------
# servers


def _listen() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class Served:
    """An ASGI app on a loopback socket in a background thread."""

    def __init__(self, app):
        self.sock = _listen()
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class FakeInstance:
    """A vLLM-like instance: `mode` picks its behaviour; `requests` records what it was sent."""

    def __init__(self, name: str, mode: str = "ok"):
        self.name, self.mode = name, mode
        self.requests: list[tuple[str, dict, dict]] = []
        self.healthy = True
        self.gate = threading.Event()  # mode "hold": answers only once set
        self.gate.set()
        self.in_flight = 0
        self.disconnected = 0
        self.kv_mode = "push"  # what it answers a router asking who it is (kvconnect_identify)
        self.kv_tp = 1  # the TP size it answers with
        self.kv_ranks: dict = {}  # and where its ranks listen (when several)
        self.prefill_gate = threading.Event()  # a push-mode prefill half answers only once set
        self.prefill_gate.set()
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/completions", self.generate, methods=["POST"]),
                  Route("/v1/chat/completions", self.generate, methods=["POST"])]
        self.served = Served(Starlette(routes=routes))
        self.url = self.served.url

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": f"model-of-{self.name}", "object": "model"}]})

    async def health(self, request: Request):
        return JSONResponse({}, status_code=200 if self.healthy else 503)

    async def _wait_gate(self) -> None:
        for _ in range(3000):  # 30 s at most
            if self.gate.is_set():
                return
            await asyncio.sleep(0.01)

    async def generate(self, request: Request):
        body = await request.json()
        self.requests.append((request.url.path, body, dict(request.headers)))
        if self.mode == "error500":
            return JSONResponse({"error": {"message": "engine dead"}}, status_code=500)
        if self.mode == "error400":
            return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)
        if self.mode == "hang":
            await asyncio.sleep(60)
        params = body.get("kv_transfer_params") or {}
        if params.get("kvconnect_identify"):
            return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": {
                "remote_engine_id": self.name, "remote_host": "10.0.0.1", "remote_port": 5600,
                "tp_size": self.kv_tp, "mode": self.kv_mode, **self.kv_ranks}})
        if params.get("push_key") and params.get("do_remote_decode"):  # push mode's prefill half
            for _ in range(3000):
                if self.prefill_gate.is_set():
                    break
                await asyncio.sleep(0.01)
            return JSONResponse({"id": "p", "choices": [{"text": "x", "finish_reason": "length"}]})
        if params.get("do_remote_decode"):  # prefill half
            if self.mode == "noparams":
                return JSONResponse({"choices": [{"text": "x"}]})
            return JSONResponse({"id": "p", "choices": [{"text": "x", "finish_reason": "length"}],
                                 "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": self.name,
                                                        "remote_block_ids": [[1, 2, 3]], "remote_host": "10.0.0.1",
                                                        "remote_port": 5600}})
        self.in_flight += 1
        if not body.get("stream"):
            try:
                await self._wait_gate()
                return JSONResponse({"id": "d", "served_by": self.name, "kv_transfer_params_seen": params,
                                     "choices": [{"text": "hello world", "finish_reason": "length"}]})
            finally:
                self.in_flight -= 1

        async def events():
            try:
                for i in range(4):
                    yield b"data: " + json.dumps({"i": i, "served_by": self.name}).encode() + b"\n\n"
                    if i == 0:
                        await self._wait_gate()
                    if i == 1 and self.mode == "cut":
                        raise RuntimeError("decode died mid-stream")
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                self.disconnected += 1
                raise
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def fakes():
    """Make fake instances with `fakes(name, mode)`; all stopped at teardown."""
    made: list[FakeInstance] = []

    def make(name: str, mode: str = "ok") -> FakeInstance:
        f = FakeInstance(name, mode)
        made.append(f)
        return f

    yield make
    for f in made:
        f.gate.set()
        f.served.stop()


@pytest.fixture
def router():
    """Start the real router app with `router(prefill_urls, decode_urls, **config)`; returns its base URL."""
    made: list[Served] = []

    def make(prefill, decode, **kw):
        kw.setdefault("health_interval_s", 0.2)
        kw.setdefault("connect_timeout_s", 2.0)
        app = create_app(ProxyConfig(prefill=[getattr(p, "url", p) for p in prefill],
                                     decode=[getattr(d, "url", d) for d in decode], **kw))
        s = Served(app)
        s.app = app
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def dead_url() -> str:
    """A loopback URL where nothing listens (the port was bound and released)."""
    s = _listen()
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def post(base: str, path: str = "/v1/completions", **body) -> httpx.Response:
    body.setdefault("model", "m")
    body.setdefault("prompt", "hi")
    return httpx.post(base + path, json=body, timeout=30)


def wait_until(fn, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def outstanding(served: Served) -> dict[str, int]:
    r = httpx.get(served.url + "/health", timeout=10).json()
    return {i["url"]: i["outstanding"] for i in r["instances"]}


# ---------------------------------------------------------------------------------------------
# routing


def test_completion_runs_prefill_then_decode_with_its_params(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d])
    resp = post(r.url, max_tokens=17, temperature=0, kv_transfer_params={"remote_host": "attacker"})
    assert resp.status_code == 200, resp.text
    (path, pre, _), = p.requests
    assert path == "/v1/completions"
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    (_, dec, _), = d.requests
    assert dec["max_tokens"] == 17 and dec["temperature"] == 0
    # Decode gets prefill's params, never what the client put in the body.
    assert dec["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert resp.json()["served_by"] == "d0"
    assert resp.json()["kv_transfer_params_seen"]["remote_block_ids"] == [[1, 2, 3]]


def test_chat_completion_caps_both_token_limits_at_prefill(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d])
    resp = post(r.url, "/v1/chat/completions", prompt=None, messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=9, stream_options={"include_usage": True})
    assert resp.status_code == 200, resp.text
    (path, pre, _), = p.requests
    assert path == "/v1/chat/completions"
    assert pre["max_completion_tokens"] == 1 and pre["max_tokens"] == 1 and "stream_options" not in pre
    (_, dec, _), = d.requests
    assert dec["max_completion_tokens"] == 9 and dec["messages"] == [{"role": "user", "content": "hi"}]


def test_request_id_and_authorization_reach_both_instances(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d])
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "x"}, timeout=30,
                      headers={"Authorization": "Bearer tok", "X-Request-Id": "req-42", "Cookie": "no"})
    assert resp.status_code == 200
    for f in (p, d):
        headers = f.requests[0][2]
        assert headers["authorization"] == "Bearer tok" and headers["x-request-id"] == "req-42"
        assert "cookie" not in headers


def test_stream_is_relayed_event_by_event(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d])
    d.gate.clear()  # decode sends its first event, then waits
    with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        # The first event reached the client while decode still held the rest back: nothing is buffered.
        assert json.loads(first.removeprefix("data: ")) == {"i": 0, "served_by": "d0"}
        d.gate.set()
        rest = [line for line in lines if line]
    assert [json.loads(x.removeprefix("data: "))["i"] for x in rest[:-1]] == [1, 2, 3]
    assert rest[-1] == "data: [DONE]"
    assert p.requests[0][1]["stream"] is False and d.requests[0][1]["stream"] is True
    wait_until(lambda: outstanding(r) == {p.url: 0, d.url: 0}, what="instances released")


def test_least_outstanding_instance_gets_the_next_request(fakes, router):
    p = fakes("p0")
    d0, d1 = fakes("d0"), fakes("d1")
    r = router([p], [d0, d1])
    d0.gate.clear()
    d1.gate.clear()
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(post(r.url))) for _ in range(2)]
    for t in threads:
        t.start()
    # Two requests in flight: one on each decode instance, not both on the first.
    wait_until(lambda: d0.in_flight == 1 and d1.in_flight == 1, what="one request on each decode instance")
    d1.gate.set()  # d1 drains; d0 still busy, so the next two go to d1
    wait_until(lambda: d1.in_flight == 0, what="d1 to finish")
    assert outstanding(r)[d0.url] == 1
    for _ in range(2):
        assert post(r.url).json()["served_by"] == "d1"
    d0.gate.set()
    for t in threads:
        t.join(30)
    assert [x.status_code for x in results] == [200, 200]
    assert outstanding(r) == {p.url: 0, d0.url: 0, d1.url: 0}


def test_equal_loads_take_turns(fakes, router):
    p0, p1, d = fakes("p0"), fakes("p1"), fakes("d0")
    r = router([p0, p1], [d])
    for _ in range(4):
        assert post(r.url).status_code == 200
    assert (len(p0.requests), len(p1.requests)) == (2, 2)


# ---------------------------------------------------------------------------------------------
# failures


def test_unreachable_prefill_is_skipped_and_marked_down(fakes, router):
    victim, p, d = fakes("p-victim"), fakes("p0"), fakes("d0")
    r = router([victim, p], [d], health_interval_s=60)  # no probe before the requests: they must notice
    gone = victim.url
    victim.served.stop()
    for _ in range(3):
        assert post(r.url).status_code == 200
    assert len(p.requests) == 3 and victim.requests == []
    health = httpx.get(r.url + "/health", timeout=10).json()
    down = {i["url"]: i["error"] for i in health["instances"] if not i["up"]}
    assert list(down) == [gone] and down[gone]
    metrics = httpx.get(r.url + "/metrics", timeout=10).text
    assert f'kvconnect_proxy_instance_up{{instance="{gone}",role="prefill"}} 0.0' in metrics


def test_decode_down_at_start_is_refused_with_503(fakes, router):
    p = fakes("p0")
    r = router([p], [dead_url()], health_interval_s=60)
    resp = post(r.url)
    assert resp.status_code == 503 and "no live decode instance" in resp.json()["error"]["message"]
    assert p.requests == []


def test_no_reachable_decode_is_a_502_then_503(fakes, router):
    p, d0, d1 = fakes("p0"), fakes("d0"), fakes("d1")
    r = router([p], [d0, d1], health_interval_s=60)
    d0.served.stop()
    d1.served.stop()
    first = post(r.url)
    assert first.status_code == 502
    assert "no decode instance reachable" in first.json()["error"]["message"]
    again = post(r.url)  # both now marked down: refused without trying
    assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(r.url + "/health", timeout=10).status_code == 503


def test_prefill_server_error_is_a_502_naming_the_instance(fakes, router):
    p, d = fakes("p0", "error500"), fakes("d0")
    r = router([p], [d])
    resp = post(r.url)
    assert resp.status_code == 502
    msg = resp.json()["error"]["message"]
    assert p.url in msg and "500" in msg and "engine dead" in msg
    assert d.requests == []
    assert outstanding(r) == {p.url: 0, d.url: 0}


def test_prefill_client_error_keeps_its_status(fakes, router):
    p, d = fakes("p0", "error400"), fakes("d0")
    r = router([p], [d])
    resp = post(r.url)
    assert resp.status_code == 400 and "prompt too long" in resp.json()["error"]["message"]


def test_prefill_without_transfer_params_is_a_502_saying_why(fakes, router):
    p, d = fakes("p0", "noparams"), fakes("d0")
    r = router([p], [d])
    resp = post(r.url)
    assert resp.status_code == 502 and "kv_transfer_params" in resp.json()["error"]["message"]
    assert d.requests == []


def test_decode_server_error_is_a_502(fakes, router):
    p, d = fakes("p0"), fakes("d0", "error500")
    r = router([p], [d])
    for stream in (False, True):
        resp = post(r.url, stream=stream)
        assert resp.status_code == 502 and d.url in resp.json()["error"]["message"]
    assert outstanding(r) == {p.url: 0, d.url: 0}


def test_hung_prefill_ends_in_504_at_the_deadline(fakes, router):
    p, d = fakes("p0", "hang"), fakes("d0")
    r = router([p], [d], request_timeout_s=1.0)
    resp = post(r.url)  # the client's own timeout (30 s) is far beyond the router's deadline
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout"
    assert outstanding(r) == {p.url: 0, d.url: 0}


def test_hung_decode_stream_ends_with_an_error_event(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d], request_timeout_s=1.5)
    d.gate.clear()  # first event, then silence past the deadline
    resp = post(r.url, stream=True)
    events = [x for x in resp.text.split("\n\n") if x]
    assert json.loads(events[0].removeprefix("data: "))["i"] == 0
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 504
    assert events[-1] == "data: [DONE]"
    d.gate.set()
    wait_until(lambda: outstanding(r) == {p.url: 0, d.url: 0}, what="instances released")


def test_decode_cut_off_mid_stream_ends_with_an_error_event(fakes, router):
    p, d = fakes("p0"), fakes("d0", "cut")
    r = router([p], [d])
    resp = post(r.url, stream=True)
    events = [x for x in resp.text.split("\n\n") if x]
    assert [json.loads(e.removeprefix("data: "))["i"] for e in events[:2]] == [0, 1]
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == 502 and "broke off the stream" in err["message"]
    assert events[-1] == "data: [DONE]"
    metrics = httpx.get(r.url + "/metrics", timeout=10).text
    assert 'kvconnect_proxy_requests_total{code="stream_error",route="/v1/completions"} 1.0' in metrics


def test_client_leaving_a_stream_frees_the_decode_instance(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d])
    d.gate.clear()
    with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as resp:
        next(line for line in resp.iter_lines() if line)
    # The client is gone with decode still holding back: the router drops decode and frees its count.
    wait_until(lambda: outstanding(r)[d.url] == 0, what="decode released after the client left")
    wait_until(lambda: d.disconnected == 1, what="decode to see the upstream stream closed")


def test_health_follows_probes(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d], health_interval_s=0.1)
    assert httpx.get(r.url + "/health", timeout=10).status_code == 200
    d.healthy = False
    wait_until(lambda: httpx.get(r.url + "/health", timeout=10).status_code == 503, what="router to see decode down")
    assert post(r.url).status_code == 503
    d.healthy = True
    wait_until(lambda: httpx.get(r.url + "/health", timeout=10).status_code == 200, what="router to see decode back")
    assert post(r.url).status_code == 200


# ---------------------------------------------------------------------------------------------
# input


@pytest.mark.parametrize("content, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"prompt": "x", "n": 2}', 400, "n > 1"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "stream must be a boolean"),
])
def test_bad_requests_are_refused_before_any_instance_is_called(fakes, router, content, status, words):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d])
    resp = httpx.post(r.url + "/v1/completions", content=content, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status and words in resp.json()["error"]["message"]
    assert p.requests == [] and d.requests == []


def test_oversized_body_is_refused(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d], max_body_bytes=1024)
    assert post(r.url, prompt="x" * 2000).status_code == 413
    assert p.requests == []


def test_metrics_count_requests_by_route_and_status(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d])
    post(r.url)
    post(r.url, "/v1/chat/completions", messages=[])
    httpx.post(r.url + "/v1/completions", content=b"{", timeout=30)
    m = httpx.get(r.url + "/metrics", timeout=10)
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    assert 'kvconnect_proxy_requests_total{code="200",route="/v1/completions"} 1.0' in text
    assert 'kvconnect_proxy_requests_total{code="200",route="/v1/chat/completions"} 1.0' in text
    assert 'kvconnect_proxy_requests_total{code="400",route="/v1/completions"} 1.0' in text
    assert "kvconnect_proxy_prefill_seconds_count 2.0" in text


# ---------------------------------------------------------------------------------------------
# pool and command line


def test_pool_refuses_bad_and_repeated_urls():
    with pytest.raises(ValueError, match="http"):
        Pool("decode", ["tcp://x:1"])
    with pytest.raises(ValueError, match="twice"):
        Pool("decode", ["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="at least one"):
        Pool("prefill", [])
    assert normalise_url(" http://a:1/ ") == "http://a:1"


def test_pool_picks_least_outstanding_and_skips_down_instances():
    pool = Pool("decode", ["http://a:1", "http://b:1", "http://c:1"])
    a, b, c = pool.instances
    got = [pool.acquire() for _ in range(3)]
    assert {i.url for i in got} == {"http://a:1", "http://b:1", "http://c:1"}
    pool.release(b, ok=True)
    assert pool.acquire() is b  # the only one with nothing in flight
    pool.mark(a, False, "refused")
    pool.mark(b, False, "refused")
    pool.release(c, ok=True)
    assert pool.acquire() is c and pool.acquire() is c
    pool.mark(c, False, "refused")
    with pytest.raises(NoInstanceError, match="refused"):
        pool.acquire()


def test_config_refuses_non_positive_timeouts():
    with pytest.raises(ValueError, match="request_timeout_s"):
        ProxyConfig(prefill=["http://a:1"], decode=["http://b:1"], request_timeout_s=0)


def test_proxy_command_serves_and_logs_no_line_per_health_probe(fakes):
    p, d = fakes("p0"), fakes("d0")
    s = _listen()
    port = s.getsockname()[1]
    s.close()
    cmd = [sys.executable, "-m", "kvconnect.cli", "proxy", "--prefill", p.url, "--decode", d.url, "--port", str(port),
           "--health-interval-s", "0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read()
                return False

        wait_until(up, timeout=60, what="kvconnect proxy to serve")
        assert post(base).json()["served_by"] == "d0"
        d.healthy = False
        wait_until(lambda: not up(), what="decode to be probed down")
        time.sleep(0.5)  # a few more probes of the instance that is down
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    # At the default log level: where it listens, what it routes to, state changes; not httpx's line per call.
    assert f"listening on http://127.0.0.1:{port}" in out and f"decode instances {d.url}" in out, out
    assert f"decode instance {d.url} is down" in out and "HTTP Request:" not in out, out


def _proxy_main(capsys, *argv: str) -> tuple[int, str]:
    from kvconnect.cli import main

    try:
        code = main(["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", *argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_an_address_the_router_cannot_listen_on_is_a_bad_command_line(capsys):
    taken = _listen()
    taken.listen()
    try:
        port = taken.getsockname()[1]
        code, err = _proxy_main(capsys, "--port", str(port))
    finally:
        taken.close()
    assert code == 2 and err.strip() == f"kvconnect proxy: error: --port: cannot listen on 127.0.0.1:{port}: " \
                                        "Address already in use", err
    # 192.0.2.1 is TEST-NET-1: never an address of this host.
    code, err = _proxy_main(capsys, "--host", "192.0.2.1", "--port", "8000")
    assert code == 2 and "--host: cannot listen on 192.0.2.1:8000" in err and len(err.strip().splitlines()) == 1, err


def test_wildcard_refusals_name_what_each_caller_sets(capsys):
    from kvconnect.config import ConnectorConfig
    from kvconnect.errors import KVConnectError

    code, err = _proxy_main(capsys, "--host", "0.0.0.0")
    assert code == 2 and "'0.0.0.0'" in err and "--allow-wildcard" in err, err
    # The connector's setting (the same key in vLLM's kv_connector_extra_config), not the router's flag.
    with pytest.raises(KVConnectError, match="set allow_wildcard to true") as refused:
        ConnectorConfig(role="producer", host="0.0.0.0")
    assert "--allow-wildcard" not in str(refused.value)


def test_unknown_routes_answer_an_openai_error_body(fakes, router):
    r = router([fakes("p0")], [fakes("d0")])
    got = httpx.post(r.url + "/v1/embeddings", json={"model": "m", "input": "x"}, timeout=10)
    assert got.status_code == 404 and got.headers["content-type"] == "application/json"
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 404
    assert "POST /v1/embeddings" in error["message"] and "POST /v1/completions" in error["message"]
    got = httpx.get(r.url + "/v1/completions", timeout=10)
    assert got.status_code == 405 and got.json()["error"]["code"] == 405


def test_models_come_from_a_live_decode_instance(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d])
    got = httpx.get(r.url + "/v1/models", timeout=10)
    assert got.status_code == 200 and got.json()["data"][0]["id"] == "model-of-d0"


def test_models_without_a_reachable_decode_is_a_503(fakes, router):
    p = fakes("p0")
    r = router([p], [dead_url()])
    got = httpx.get(r.url + "/v1/models", timeout=10)
    assert got.status_code == 503 and "GET /v1/models" in got.json()["error"]["message"]


def test_the_router_logs_state_changes_and_failed_requests(fakes, router, caplog):
    caplog.set_level("INFO", logger="kvconnect.proxy")
    p, d = fakes("p0", "error500"), fakes("d0")
    r = router([p], [d], health_interval_s=0.1)
    assert post(r.url).status_code == 502
    d.healthy = False
    wait_until(lambda: any("decode instance" in m and "is down" in m for m in caplog.messages), what="down logged")
    d.healthy = True
    wait_until(lambda: any("is up again" in m for m in caplog.messages), what="up logged")
    text = "\n".join(caplog.messages)
    assert f"prefill instances {p.url}" in text and "failed with 502" in text and p.url in text


# ---------------------------------------------------------------------------------------------
# push mode


def test_push_mode_sends_both_halves_at_once_joined_by_one_key(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    r = router([p], [d], mode="push")
    p.prefill_gate.clear()  # the prefill is still computing when decode gets its half
    result = {}
    t = threading.Thread(target=lambda: result.update(resp=post(r.url, max_tokens=9)))
    t.start()
    wait_until(lambda: len(d.requests) == 1, what="decode to get its half before prefill answered")
    p.prefill_gate.set()
    t.join(30)
    assert result["resp"].status_code == 200, result["resp"].text
    (_, ident, _), (_, pre, _) = p.requests
    assert ident["kv_transfer_params"] == {"kvconnect_identify": True} and ident["max_tokens"] == 1
    key = pre["kv_transfer_params"]["push_key"]
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "push_key": key} and pre["max_tokens"] == 1
    (_, dec, _), = d.requests
    assert dec["max_tokens"] == 9
    assert dec["kv_transfer_params"] == {"do_remote_prefill": True, "push_key": key, "remote_engine_id": "p0",
                                         "remote_host": "10.0.0.1", "remote_port": 5600, "remote_tp_size": 1}
    # The prefill's address is asked once, then kept.
    assert post(r.url).status_code == 200
    # The prefill half goes in the background: the client may have its answer before prefill got it.
    wait_until(lambda: len(p.requests) == 3, what="the second request's prefill half")
    assert [b["kv_transfer_params"].get("kvconnect_identify") for _, b, _ in p.requests].count(True) == 1
    assert len({b["kv_transfer_params"].get("push_key") for _, b, _ in p.requests[1:]}) == 2


def test_push_mode_refuses_a_prefill_that_does_not_run_push(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    p.kv_mode = "pull"
    r = router([p], [d], mode="push")
    resp = post(r.url)
    assert resp.status_code == 502 and "cannot serve push mode" in resp.json()["error"]["message"]
    assert not d.requests


def test_push_mode_tells_decode_the_tp_size_of_a_prefill_of_several_ranks(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    p.kv_tp, p.kv_ranks = 2, {"remote_ranks": [["10.0.0.1", 5600], ["10.0.0.1", 5601]]}
    r = router([p], [d], mode="push")
    assert post(r.url).status_code == 200
    (_, dec, _), = d.requests
    assert dec["kv_transfer_params"]["remote_tp_size"] == 2 and dec["kv_transfer_params"]["remote_port"] == 5600


def test_push_mode_refuses_a_prefill_whose_ranks_are_not_at_port_plus_rank(fakes, router):
    p, d = fakes("p0"), fakes("d0")
    p.kv_tp, p.kv_ranks = 2, {"remote_ranks": [["10.0.0.1", 5600], ["10.0.0.1", 41234]]}
    r = router([p], [d], mode="push")
    resp = post(r.url)
    assert resp.status_code == 502 and "port + rank" in resp.json()["error"]["message"]
    assert not d.requests


def test_proxy_config_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be pull or push"):
        ProxyConfig(prefill=["http://a:1"], decode=["http://b:1"], mode="both")
