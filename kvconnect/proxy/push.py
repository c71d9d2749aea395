"""Push mode for the router: the prefill and the decode instance get the request at once, joined by a key.

In pull mode the decode request waits for the prefill's answer, which carries the transfer params.
In push mode the router sends both at once: the prefill request carries `push_key`, the decode
request the same key and where the prefill's side channel is (rank 0's address and the prefill's
TP size: rank r listens at port + r), so that the decode can offer its
blocks while the prefill computes. The router learns that address once per prefill instance (a
one-token request with `kvconnect_identify`, answered with the instance's side channel and nothing
held) and forgets it when the instance is marked down. The prefill's answer is read in the
background: a prefill that fails is logged and counted, and the decode, which then never gets its
WRITE, fails or recomputes at its own load deadline (its `kv_load_failure_policy`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import httpx
import msgspec

from kvconnect.proxy.bodies import prefill_body
from kvconnect.proxy.config import COMPLETIONS
from kvconnect.proxy.errors import ProxyError
from kvconnect.proxy.pool import Instance, NoInstanceError
from kvconnect.proxy.upstream import Upstream
from kvconnect.wire import MAX_TP

log = logging.getLogger("kvconnect.proxy")


async def start(up: Upstream, route: str, body: dict[str, Any], headers: dict[str, str],
                deadline: float) -> dict[str, Any]:
    """Send the prefill half in the background; return the kv_transfer_params of the decode half."""
    try:
        inst = up.prefill.acquire()
    except NoInstanceError as exc:
        raise ProxyError(503, str(exc), "service_unavailable") from None
    try:
        where = await identify(up, inst, body.get("model"), headers, deadline)
    except BaseException:
        up.prefill.release(inst, ok=False)
        raise
    key = uuid.uuid4().hex
    pre = dict(prefill_body(body, route), kv_transfer_params={"do_remote_decode": True, "push_key": key})
    task = asyncio.create_task(_prefill(up, inst, route, pre, headers, deadline))
    up.background.add(task)
    task.add_done_callback(up.background.discard)
    return {"do_remote_prefill": True, "push_key": key, "remote_engine_id": where["remote_engine_id"],
            "remote_host": where["remote_host"], "remote_port": where["remote_port"],
            "remote_tp_size": where.get("tp_size", 1)}


async def identify(up: Upstream, inst: Instance, model: Any, headers: dict[str, str],
                   deadline: float) -> dict[str, Any]:
    """Where a prefill instance's side channel listens (asked once, then kept)."""
    known = up.identities.get(inst.url)
    if known is not None:
        return known
    body = {"prompt": [0], "max_tokens": 1, "kv_transfer_params": {"kvconnect_identify": True}}
    if model is not None:
        body["model"] = model
    try:
        resp = await up.client.post(inst.url + COMPLETIONS, json=body, headers=headers,
                                    timeout=up.timeout(min(deadline - time.monotonic(),
                                                           up.config.connect_timeout_s * 6)))
    except httpx.HTTPError as exc:
        up.mark(up.prefill, inst, False, f"identify: {type(exc).__name__}: {exc}")
        up.metrics.failures.labels("prefill", inst.url, "connect").inc()
        raise ProxyError(502, f"prefill instance {inst.url} did not say where it listens: "
                              f"{type(exc).__name__}: {exc}") from None
    try:
        params = resp.json().get("kv_transfer_params") or {}
    except (ValueError, AttributeError):
        params = {}
    if resp.status_code != 200 or not {"remote_host", "remote_port", "remote_engine_id"} <= set(params):
        up.metrics.failures.labels("prefill", inst.url, "no_params").inc()
        raise ProxyError(502, f"prefill instance {inst.url} did not say where it listens (answer "
                              f"{resp.status_code}): is it running a kvconnect connector?")
    tp = params.get("tp_size", 1)
    if params.get("mode") != "push" or not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
        raise ProxyError(502, f"prefill instance {inst.url} cannot serve push mode (mode {params.get('mode')!r}, "
                              f"TP {tp!r}): set mode \"push\" in its kv_connector_extra_config, or run the router "
                              "in pull mode")
    where = [[params["remote_host"], params["remote_port"] + r] for r in range(tp)]
    if tp > 1 and params.get("remote_ranks") != where:
        raise ProxyError(502, f"prefill instance {inst.url} of TP {tp} does not listen at port + rank for every "
                              f"rank (ranks at {params.get('remote_ranks')!r}): set `port` in its "
                              "kv_connector_extra_config, or run the router in pull mode")
    up.identities[inst.url] = params
    return params


async def _prefill(up: Upstream, inst: Instance, route: str, body: dict[str, Any], headers: dict[str, str],
                   deadline: float) -> None:
    """The prefill half: its answer is only read, to count it and to report a failure."""
    t0, ok = time.monotonic(), False
    try:
        resp = await up.client.post(inst.url + route, content=msgspec.json.encode(body),
                                    headers={**headers, "content-type": "application/json"},
                                    timeout=up.timeout(deadline - time.monotonic()))
        ok = resp.status_code == 200
        if not ok:
            up.metrics.failures.labels("prefill", inst.url, "status").inc()
            log.warning("kvconnect proxy: push prefill of request %s on %s answered %d: %s",
                        headers.get("x-request-id"), inst.url, resp.status_code, resp.text[:300])
    except httpx.HTTPError as exc:
        up.metrics.failures.labels("prefill", inst.url, "protocol").inc()
        log.warning("kvconnect proxy: push prefill of request %s on %s failed: %s: %s",
                    headers.get("x-request-id"), inst.url, type(exc).__name__, exc)
    finally:
        up.prefill.release(inst, ok=ok)
        if ok:
            up.metrics.prefill_seconds.observe(time.monotonic() - t0)
