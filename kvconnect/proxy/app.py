"""The P/D router as an ASGI app: each request runs as prefill, then decode (pull), or both at once (push).

Mechanism only; which instance serves a request is `pool.Pool`'s decision, the calls to instances are
`upstream.Upstream`'s, and the two flows are `pull` and `push`. Every upstream wait is bounded by the
request's deadline, and every failure reaches the client as an OpenAI-style error body (or, once a
stream has started, as a final `data: {"error": ...}` event), never as a hang.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator

import httpx
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvconnect.proxy import pull, push
from kvconnect.proxy.bodies import check_request
from kvconnect.proxy.config import CHAT, COMPLETIONS, FORWARDED_HEADERS, MODELS, ProxyConfig
from kvconnect.proxy.errors import ProxyError
from kvconnect.proxy.relay import relay_stream
from kvconnect.proxy.upstream import Upstream

__all__ = ["CHAT", "COMPLETIONS", "FORWARDED_HEADERS", "MODELS", "ProxyConfig", "Router", "create_app"]

log = logging.getLogger("kvconnect.proxy")


class Router:
    """Serves the routes: health, metrics, models, and completions run through prefill and decode."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.up = Upstream(config)
        self._start = push.start if config.mode == "push" else pull.start

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Open the client, probe once before serving, keep probing in the background."""
        async with self.up.running():
            yield

    # ---- routes ----

    async def health(self, request: Request) -> Response:
        """200 when at least one prefill and one decode instance answered their last probe."""
        up = self.up
        ready = up.probed and up.prefill.any_up and up.decode.any_up
        instances = [{"role": i.role, "url": i.url, "up": i.up, "outstanding": i.outstanding,
                      "served": i.served, "error": i.last_error}
                     for pool in (up.prefill, up.decode) for i in pool.instances]
        return JSONResponse({"status": "ok" if ready else "unavailable", "instances": instances},
                            status_code=200 if ready else 503)

    async def metrics_route(self, request: Request) -> Response:
        """Prometheus exposition of the router's own series."""
        return Response(generate_latest(self.up.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the first live decode instance's list (the model clients address)."""
        started, up = time.monotonic(), self.up
        try:
            for inst in [i for i in up.decode.instances if i.up] or up.decode.instances:
                try:
                    resp = await up.client.get(inst.url + MODELS, timeout=up.timeout(self.config.connect_timeout_s),
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
        up.metrics.requests.labels(MODELS, str(out.status_code)).inc()
        up.metrics.seconds.labels(MODELS).observe(time.monotonic() - started)
        return out

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._serve(request, COMPLETIONS)

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._serve(request, CHAT)

    async def _serve(self, request: Request, route: str) -> Response:
        started, up = time.monotonic(), self.up
        deadline = started + self.config.request_timeout_s
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        try:
            body = check_request(await self._read_json(request))
            if not up.decode.any_up:  # fail before prefill holds blocks no decode will pull
                raise ProxyError(503, f"no live decode instance: "
                                      f"{', '.join(f'{i.url} ({i.last_error})' for i in up.decode.instances)}",
                                 "service_unavailable")
            params = await self._start(up, route, body, headers, deadline)
            inst, resp = await up.send(up.decode, route, dict(body, kv_transfer_params=params), headers, deadline)
            if body.get("stream", False) and resp.status_code == 200:
                return relay_stream(up, route, inst, resp, deadline, started)
            ok = False
            try:
                content = await up.read_body(up.decode, inst, resp, deadline)
                ok = resp.status_code < 500
            finally:
                up.decode.release(inst, ok=ok)
            out = up.reply(up.decode, inst, resp, content)
        except ProxyError as exc:
            log.warning("kvconnect proxy: request %s to %s failed with %d: %s", headers["x-request-id"], route,
                        exc.status, exc.message)
            out = JSONResponse(exc.body(), status_code=exc.status)
        up.metrics.requests.labels(route, str(out.status_code)).inc()
        up.metrics.seconds.labels(route).observe(time.monotonic() - started)
        return out

    async def _read_json(self, request: Request) -> Any:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise ProxyError(413, f"request body over {limit} bytes", "invalid_request_error")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ProxyError(413, f"request body over {limit} bytes", "invalid_request_error")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ProxyError(400, "client went away while sending the body", "invalid_request_error")
        try:
            return msgspec.json.decode(b"".join(chunks))
        except msgspec.DecodeError as exc:
            raise ProxyError(400, f"request body is not valid JSON: {exc}", "invalid_request_error")


async def no_such_route(request: Request, exc: HTTPException) -> Response:
    """An unknown route or method as an OpenAI error body (404 or 405), naming the routes there are."""
    served = ", ".join(f"{'/'.join(sorted(set(r.methods) - {'HEAD'}))} {r.path}" for r in request.app.routes)
    what = "no route" if exc.status_code == 404 else "method not allowed:"
    error = ProxyError(exc.status_code, f"{what} {request.method} {request.url.path}; kvconnect proxy serves "
                                        f"{served}", "invalid_request_error")
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


def create_app(config: ProxyConfig) -> Starlette:
    """The router as an ASGI app (serve it with uvicorn, or `kvconnect proxy`)."""
    router = Router(config)
    app = Starlette(routes=[
        Route(COMPLETIONS, router.completions, methods=["POST"]),
        Route(CHAT, router.chat, methods=["POST"]),
        Route(MODELS, router.models, methods=["GET"]),
        Route("/health", router.health, methods=["GET"]),
        Route("/metrics", router.metrics_route, methods=["GET"]),
    ], lifespan=router.lifespan, exception_handlers={404: no_such_route, 405: no_such_route})
    app.state.router = router
    return app
