"""The router's side towards the instances: the pools, one HTTP client, health probes, and bounded
calls whose every failure becomes a `ProxyError` (counted, and the instance marked down when it
could not be reached)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator

import httpx
import msgspec
from starlette.responses import Response

from kvconnect.proxy.bodies import snippet
from kvconnect.proxy.config import ProxyConfig
from kvconnect.proxy.errors import ProxyError
from kvconnect.proxy.metrics import RouterMetrics
from kvconnect.proxy.pool import Instance, NoInstanceError, Pool

log = logging.getLogger("kvconnect.proxy")


class Upstream:
    """Owns the instance pools, the HTTP client and the health probes; sends and reads within deadlines."""

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

    # ---- lifecycle and health ----

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Open the client, probe once before serving, keep probing in the background."""
        limits = httpx.Limits(max_connections=self.config.max_connections, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(limits=limits, timeout=self.timeout(self.config.request_timeout_s))
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

    def timeout(self, remaining: float) -> httpx.Timeout:
        """An httpx timeout for a call with `remaining` seconds left (connecting never takes longer than
        the configured connect timeout)."""
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
            r = await self.client.get(f"{inst.url}/health", timeout=self.timeout(self.config.connect_timeout_s))
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        self.mark(pool, inst, ok, why)

    def mark(self, pool: Pool, inst: Instance, up: bool, why: str = "") -> None:
        """Mark an instance up or down, logging a change once probing has begun."""
        if not up:
            self.identities.pop(inst.url, None)  # a restarted instance may listen elsewhere
        if pool.mark(inst, up, why) and self.probed:
            if up:
                log.warning("kvconnect proxy: %s instance %s is up again", pool.role, inst.url)
            else:
                log.warning("kvconnect proxy: %s instance %s is down: %s", pool.role, inst.url, why)

    # ---- calls ----

    async def send(self, pool: Pool, route: str, body: dict[str, Any], headers: dict[str, str],
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
                                                timeout=self.timeout(remaining))
                return inst, await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                pool.release(inst, ok=False)
                self.mark(pool, inst, False, f"{type(exc).__name__}: {exc}")
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

    async def read_body(self, pool: Pool, inst: Instance, resp: httpx.Response, deadline: float) -> bytes:
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

    def status_error(self, pool: Pool, inst: Instance, resp: httpx.Response, content: bytes) -> ProxyError:
        """An instance's error answer: a client error keeps its status, a server error becomes 502."""
        if 400 <= resp.status_code < 500:
            return ProxyError(resp.status_code, f"{pool.role} instance refused the request: {snippet(content)}",
                              "invalid_request_error")
        self.metrics.failures.labels(pool.role, inst.url, "status").inc()
        return ProxyError(502, f"{pool.role} instance {inst.url} answered {resp.status_code}: {snippet(content)}")

    def reply(self, pool: Pool, inst: Instance, resp: httpx.Response, content: bytes) -> Response:
        """An instance's answer passed on to the client; a server error raises as `status_error`."""
        if resp.status_code >= 500:
            raise self.status_error(pool, inst, resp, content)
        return Response(content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))
