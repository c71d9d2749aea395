"""Decode's server-sent events passed through to the client as they come, within the request's
deadline; a failure mid-stream ends the stream with an error event, never a hang."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import msgspec
from starlette.responses import StreamingResponse

from kvconnect.proxy.errors import ProxyError
from kvconnect.proxy.pool import Instance
from kvconnect.proxy.upstream import Upstream

log = logging.getLogger("kvconnect.proxy")


def relay_stream(up: Upstream, route: str, inst: Instance, resp: httpx.Response, deadline: float,
                 started: float) -> StreamingResponse:
    """Pass decode's server-sent events through as they come; a failure mid-stream ends it with an error event."""
    state = {"ok": False, "done": False}

    async def finish() -> None:
        # Runs once, whether the stream ended, failed, or the client left before it began.
        if state["done"]:
            return
        state["done"] = True
        await resp.aclose()
        up.decode.release(inst, ok=state["ok"])
        if not state["ok"]:
            log.warning("kvconnect proxy: stream from decode instance %s to %s ended early", inst.url, route)
        up.metrics.requests.labels(route, "200" if state["ok"] else "stream_error").inc()
        up.metrics.seconds.labels(route).observe(time.monotonic() - started)

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
            up.metrics.failures.labels("decode", inst.url, "timeout").inc()
            yield _sse_error(ProxyError(504, f"decode instance {inst.url} did not finish within the request "
                                             f"timeout ({up.config.request_timeout_s} s)", "timeout"))
        except httpx.HTTPError as exc:
            up.metrics.failures.labels("decode", inst.url, "protocol").inc()
            yield _sse_error(ProxyError(502, f"decode instance {inst.url} broke off the stream: "
                                             f"{type(exc).__name__}: {exc}"))
        finally:
            await finish()

    # The status line goes out before the first event, so the request is counted when the stream ends.
    return _Relay(events(), finish, status_code=200, media_type=resp.headers.get("content-type", "text/event-stream"))


class _Relay(StreamingResponse):
    """A streaming response that always runs its cleanup, even when the client leaves before the first event."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kw: Any):
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def _sse_error(err: ProxyError) -> bytes:
    return b"data: " + msgspec.json.encode(err.body()) + b"\n\ndata: [DONE]\n\n"
