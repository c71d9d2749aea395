"""The P/D router as an ASGI app: prefill with `do_remote_decode`, then decode with the returned params.

Mechanism only; which instance serves a request is `pool.Pool`'s decision. Every upstream wait is
bounded by the request's deadline, and every failure reaches the client as an OpenAI-style error
body (or, once a stream has started, as a final `data: {"error": ...}` event), never as a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvconnect.proxy import push
from kvconnect.proxy.errors import ProxyError
from kvconnect.proxy.metrics import RouterMetrics
from kvconnect.proxy.pool import Instance, NoInstanceError, Pool

log = logging.getLogger("kvconnect.proxy")

COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
CHAT = "/v1/chat/completions"
# Headers passed on to both instances: the client's credentials for vLLM's --api-key, and a request id
# so that the prefill and decode halves of one request can be found in both logs.
FORWARDED_HEADERS = ("authorization", "x-request-id")


@dataclass
class ProxyConfig:
    """Everything `kvconnect proxy` takes from its command line."""

    prefill: list[str]
    decode: list[str]
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    health_interval_s: float = 5.0
    max_body_bytes: int = 16 << 20
    max_connections: int = 512
    mode: str = "pull"  # "push": prefill and decode get the request at once (see kvconnect.proxy.push)

    def __post_init__(self) -> None:
        if self.mode not in ("pull", "push"):
            raise ValueError(f"mode must be pull or push, got {self.mode!r}")
        for name in ("connect_timeout_s", "request_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_body_bytes <= 0 or self.max_connections <= 0:
            raise ValueError("max_body_bytes and max_connections must be positive")


def _prefill_body(body: dict[str, Any], route: str) -> dict[str, Any]:
    """The request as prefill sees it: one token, no stream, and a request for transfer params."""
    pre = dict(body)
    pre["stream"] = False
    pre.pop("stream_options", None)
    pre.pop("min_tokens", None)
    pre["max_tokens"] = 1
    if route == CHAT and "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return pre


def _check_request(body: Any) -> dict[str, Any]:
    """Refuse what P/D routing cannot serve before any instance is bothered."""
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", "invalid_request_error")
    for key in ("n", "best_of"):
        if body.get(key, 1) not in (1, None):
            raise ProxyError(400, f"{key} > 1 is not supported by P/D routing", "invalid_request_error")
    if not isinstance(body.get("stream", False), bool):
        raise ProxyError(400, "stream must be a boolean", "invalid_request_error")
    return body


def _snippet(content: bytes, limit: int = 300) -> str:
    text = content[:limit].decode("utf-8", "replace").strip()
    return text + ("..." if len(content) > limit else "")


class Router:
    """Owns the instance pools, the HTTP client and the health probes; serves the routes."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.prefill = Pool("prefill", config.prefill)
        self.decode = Pool("decode", config.decode)
        self.metrics = RouterMetrics([self.prefill, self.decode])
        self.client: httpx.AsyncClient | None = None
        self.probed = False
        self._probe_task: asyncio.Task | None = None
        self.identities: dict[str, dict[str, Any]] = {}  # push mode: prefill URL -> where its side channel is
        self.background: set[asyncio.Task] = set()  # push mode: prefill requests in flight

    # ---- lifecycle ----

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Open the client, probe once before serving, keep probing in the background."""
        limits = httpx.Limits(max_connections=self.config.max_connections, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(limits=limits, timeout=self._timeout(self.config.request_timeout_s))
        for pool in (self.prefill, self.decode):
            log.info("kvconnect proxy: %s instances %s", pool.role, ", ".join(i.url for i in pool.instances))
        await self.probe_all()
        for pool in (self.prefill, self.decode):
            for inst in pool.instances:
                if not inst.up:
                    log.warning("kvconnect proxy: %s instance %s is down at start: %s", pool.role, inst.url,
                                inst.last_error)
        self._probe_task = asyncio.create_task(self._probe_loop())
        try:
            yield
        finally:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            await self.client.aclose()

    def _timeout(self, remaining: float) -> httpx.Timeout:
        remaining = max(remaining, 0.001)
        return httpx.Timeout(remaining, connect=min(self.config.connect_timeout_s, remaining))

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        """Ask every instance's GET /health once, concurrently; marks each up or down."""
        await asyncio.gather(*(self._probe(pool, inst) for pool in (self.prefill, self.decode)
                               for inst in pool.instances))
        self.probed = True

    async def _probe(self, pool: Pool, inst: Instance) -> None:
        try:
            r = await self.client.get(f"{inst.url}/health", timeout=self._timeout(self.config.connect_timeout_s))
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        self._mark(pool, inst, ok, why)

    def _mark(self, pool: Pool, inst: Instance, up: bool, why: str = "") -> None:
        if not up:
            self.identities.pop(inst.url, None)  # a restarted instance may listen elsewhere
        if pool.mark(inst, up, why) and self.probed:
            if up:
                log.warning("kvconnect proxy: %s instance %s is up again", pool.role, inst.url)
            else:
                log.warning("kvconnect proxy: %s instance %s is down: %s", pool.role, inst.url, why)

    # ---- routes ----

    async def health(self, request: Request) -> Response:
        """200 when at least one prefill and one decode instance answered their last probe."""
        ready = self.probed and self.prefill.any_up and self.decode.any_up
        instances = [{"role": i.role, "url": i.url, "up": i.up, "outstanding": i.outstanding,
                      "served": i.served, "error": i.last_error}
                     for pool in (self.prefill, self.decode) for i in pool.instances]
        return JSONResponse({"status": "ok" if ready else "unavailable", "instances": instances},
                            status_code=200 if ready else 503)

    async def metrics_route(self, request: Request) -> Response:
        """Prometheus exposition of the router's own series."""
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the first live decode instance's list (the model clients address)."""
        started = time.monotonic()
        try:
            for inst in [i for i in self.decode.instances if i.up] or self.decode.instances:
                try:
                    resp = await self.client.get(inst.url + MODELS, timeout=self._timeout(self.config.connect_timeout_s),
                                                 headers={k: v for k in FORWARDED_HEADERS
                                                          if (v := request.headers.get(k))})
                except httpx.HTTPError as exc:
                    log.warning("kvconnect proxy: GET %s on decode instance %s failed: %s: %s", MODELS, inst.url,
                                type(exc).__name__, exc)
                    continue
                out = Response(resp.content, status_code=resp.status_code if resp.status_code < 500 else 502,
                               media_type=resp.headers.get("content-type", "application/json"))
                break
            else:
                raise ProxyError(503, "no decode instance answered GET /v1/models", "service_unavailable")
        except ProxyError as exc:
            out = JSONResponse(exc.body(), status_code=exc.status)
        self.metrics.requests.labels(MODELS, str(out.status_code)).inc()
        self.metrics.seconds.labels(MODELS).observe(time.monotonic() - started)
        return out

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._serve(request, COMPLETIONS)

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._serve(request, CHAT)

    async def _serve(self, request: Request, route: str) -> Response:
        started = time.monotonic()
        deadline = started + self.config.request_timeout_s
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        try:
            body = _check_request(await self._read_json(request))
            if not self.decode.any_up:  # fail before prefill holds blocks no decode will pull
                raise ProxyError(503, f"no live decode instance: "
                                      f"{', '.join(f'{i.url} ({i.last_error})' for i in self.decode.instances)}",
                                 "service_unavailable")
            if self.config.mode == "push":
                params = await push.start(self, route, _prefill_body(body, route), headers, deadline)
            else:
                params = await self._prefill_step(route, body, headers, deadline)
            dec = dict(body)
            dec["kv_transfer_params"] = params
            inst, resp = await self._send(self.decode, route, dec, headers, deadline)
            if body.get("stream", False) and resp.status_code == 200:
                return self._relay_stream(route, inst, resp, deadline, started)
            ok = False
            try:
                content = await self._read_body(self.decode, inst, resp, deadline)
                ok = resp.status_code < 500
            finally:
                self.decode.release(inst, ok=ok)
            out = self._upstream_reply(self.decode, inst, resp, content)
        except ProxyError as exc:
            log.warning("kvconnect proxy: request %s to %s failed with %d: %s", headers["x-request-id"], route,
                        exc.status, exc.message)
            out = JSONResponse(exc.body(), status_code=exc.status)
        self.metrics.requests.labels(route, str(out.status_code)).inc()
        self.metrics.seconds.labels(route).observe(time.monotonic() - started)
        return out

    # ---- steps ----

    async def _read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.config.max_body_bytes):
            raise ProxyError(413, f"request body over {self.config.max_body_bytes} bytes", "invalid_request_error")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.config.max_body_bytes:
                    raise ProxyError(413, f"request body over {self.config.max_body_bytes} bytes",
                                     "invalid_request_error")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ProxyError(400, "client went away while sending the body", "invalid_request_error")
        try:
            return msgspec.json.decode(b"".join(chunks))
        except msgspec.DecodeError as exc:
            raise ProxyError(400, f"request body is not valid JSON: {exc}", "invalid_request_error")

    async def _prefill_step(self, route: str, body: dict[str, Any], headers: dict[str, str],
                            deadline: float) -> dict[str, Any]:
        """Run the prompt on a prefill instance; return the transfer params decode needs."""
        t0 = time.monotonic()
        inst, resp = await self._send(self.prefill, route, _prefill_body(body, route), headers, deadline)
        ok = False
        try:
            content = await self._read_body(self.prefill, inst, resp, deadline)
            if resp.status_code != 200:
                raise self._status_error(self.prefill, inst, resp, content)
            try:
                params = msgspec.json.decode(content).get("kv_transfer_params")
            except (msgspec.DecodeError, AttributeError):
                params = None
            if not isinstance(params, dict) or not params:
                self.metrics.failures.labels("prefill", inst.url, "no_params").inc()
                raise ProxyError(502, f"prefill instance {inst.url} returned no kv_transfer_params: is it "
                                      "running a kvconnect connector with kv_role kv_producer or kv_both?")
            ok = True
            return params
        finally:
            self.prefill.release(inst, ok=ok)
            if ok:
                self.metrics.prefill_seconds.observe(time.monotonic() - t0)

    async def _send(self, pool: Pool, route: str, body: dict[str, Any], headers: dict[str, str],
                    deadline: float) -> tuple[Instance, httpx.Response]:
        """POST to the least busy live instance; an unreachable one is marked down and the next tried.

        Only connection failures move on: the request never reached that instance, so trying another
        cannot run it twice. The returned instance is counted busy until the caller releases it.
        """
        payload = msgspec.json.encode(body)
        tried: set[str] = set()
        while True:
            try:
                inst = pool.acquire(exclude=frozenset(tried))
            except NoInstanceError as exc:
                raise ProxyError(503, str(exc), "service_unavailable") from None
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise httpx.TimeoutException("request deadline passed")
                req = self.client.build_request("POST", inst.url + route, content=payload,
                                                headers={**headers, "content-type": "application/json"},
                                                timeout=self._timeout(remaining))
                return inst, await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                pool.release(inst, ok=False)
                self._mark(pool, inst, False, f"{type(exc).__name__}: {exc}")
                self.metrics.failures.labels(pool.role, inst.url, "connect").inc()
                tried.add(inst.url)
                if len(tried) == len(pool.instances):
                    raise ProxyError(502, f"no {pool.role} instance reachable; last: {inst.url}: "
                                          f"{type(exc).__name__}: {exc}") from None
            except httpx.TimeoutException:
                pool.release(inst, ok=False)
                self.metrics.failures.labels(pool.role, inst.url, "timeout").inc()
                raise ProxyError(504, f"{pool.role} instance {inst.url} did not answer within the "
                                      f"request timeout ({self.config.request_timeout_s} s)", "timeout") from None
            except httpx.HTTPError as exc:
                pool.release(inst, ok=False)
                self.metrics.failures.labels(pool.role, inst.url, "protocol").inc()
                raise ProxyError(502, f"{pool.role} instance {inst.url} failed: {type(exc).__name__}: {exc}") from None

    async def _read_body(self, pool: Pool, inst: Instance, resp: httpx.Response, deadline: float) -> bytes:
        """The whole upstream body within the deadline (the caller releases the instance)."""
        try:
            return await asyncio.wait_for(resp.aread(), max(deadline - time.monotonic(), 0.001))
        except (asyncio.TimeoutError, httpx.TimeoutException):
            self.metrics.failures.labels(pool.role, inst.url, "timeout").inc()
            raise ProxyError(504, f"{pool.role} instance {inst.url} did not finish within the request timeout "
                                  f"({self.config.request_timeout_s} s)", "timeout") from None
        except httpx.HTTPError as exc:
            self.metrics.failures.labels(pool.role, inst.url, "protocol").inc()
            raise ProxyError(502, f"{pool.role} instance {inst.url} broke off its answer: "
                                  f"{type(exc).__name__}: {exc}") from None
        finally:
            await resp.aclose()

    def _status_error(self, pool: Pool, inst: Instance, resp: httpx.Response, content: bytes) -> ProxyError:
        """An instance's error answer: a client error keeps its status, a server error becomes 502."""
        if 400 <= resp.status_code < 500:
            return ProxyError(resp.status_code, f"{pool.role} instance refused the request: {_snippet(content)}",
                              "invalid_request_error")
        self.metrics.failures.labels(pool.role, inst.url, "status").inc()
        return ProxyError(502, f"{pool.role} instance {inst.url} answered {resp.status_code}: {_snippet(content)}")

    def _upstream_reply(self, pool: Pool, inst: Instance, resp: httpx.Response, content: bytes) -> Response:
        if resp.status_code >= 500:
            raise self._status_error(pool, inst, resp, content)
        return Response(content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    def _relay_stream(self, route: str, inst: Instance, resp: httpx.Response, deadline: float,
                      started: float) -> StreamingResponse:
        """Pass decode's server-sent events through as they come; a failure mid-stream ends it with an error event."""
        state = {"ok": False, "done": False}

        async def finish() -> None:
            # Runs once, whether the stream ended, failed, or the client left before it began.
            if state["done"]:
                return
            state["done"] = True
            await resp.aclose()
            self.decode.release(inst, ok=state["ok"])
            if not state["ok"]:
                log.warning("kvconnect proxy: stream from decode instance %s to %s ended early", inst.url, route)
            self.metrics.requests.labels(route, "200" if state["ok"] else "stream_error").inc()
            self.metrics.seconds.labels(route).observe(time.monotonic() - started)

        async def events() -> AsyncIterator[bytes]:
            chunks = resp.aiter_bytes()
            try:
                while True:
                    try:
                        chunk = await asyncio.wait_for(chunks.__anext__(), max(deadline - time.monotonic(), 0.001))
                    except StopAsyncIteration:
                        state["ok"] = True
                        return
                    yield chunk
            except (asyncio.TimeoutError, httpx.TimeoutException):
                self.metrics.failures.labels("decode", inst.url, "timeout").inc()
                yield _sse_error(ProxyError(504, f"decode instance {inst.url} did not finish within the request "
                                                 f"timeout ({self.config.request_timeout_s} s)", "timeout"))
            except httpx.HTTPError as exc:
                self.metrics.failures.labels("decode", inst.url, "protocol").inc()
                yield _sse_error(ProxyError(502, f"decode instance {inst.url} broke off the stream: "
                                                 f"{type(exc).__name__}: {exc}"))
            finally:
                await finish()

        # The status line goes out before the first event, so the request is counted when the stream ends.
        return _Relay(events(), finish, status_code=200,
                      media_type=resp.headers.get("content-type", "text/event-stream"))


class _Relay(StreamingResponse):
    """A streaming response that always runs its cleanup, even when the client leaves before the first event."""

    def __init__(self, content: AsyncIterator[bytes], cleanup, **kw: Any):
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def _sse_error(err: ProxyError) -> bytes:
    return b"data: " + msgspec.json.encode(err.body()) + b"\n\ndata: [DONE]\n\n"


def create_app(config: ProxyConfig) -> Starlette:
    """The router as an ASGI app (serve it with uvicorn, or `kvconnect proxy`)."""
    router = Router(config)
    app = Starlette(routes=[
        Route(COMPLETIONS, router.completions, methods=["POST"]),
        Route(CHAT, router.chat, methods=["POST"]),
        Route(MODELS, router.models, methods=["GET"]),
        Route("/health", router.health, methods=["GET"]),
        Route("/metrics", router.metrics_route, methods=["GET"]),
    ], lifespan=router.lifespan)
    app.state.router = router
    return app
