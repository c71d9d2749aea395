"""Pull mode for the router: prefill runs first, and its answer carries the transfer params that the
decode request then takes along (decode pulls the blocks)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from kvconnect.proxy.bodies import prefill_body
from kvconnect.proxy.errors import ProxyError
from kvconnect.proxy.upstream import Upstream


async def start(up: Upstream, route: str, body: dict[str, Any], headers: dict[str, str],
                deadline: float) -> dict[str, Any]:
    """Run the prompt on a prefill instance; return the transfer params decode needs."""
    t0 = time.monotonic()
    inst, resp = await up.send(up.prefill, route, prefill_body(body, route), headers, deadline)
    ok = False
    try:
        content = await up.read_body(up.prefill, inst, resp, deadline)
        if resp.status_code != 200:
            raise up.status_error(up.prefill, inst, resp, content)
        try:
            params = msgspec.json.decode(content).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            params = None
        if not isinstance(params, dict) or not params:
            up.metrics.failures.labels("prefill", inst.url, "no_params").inc()
            raise ProxyError(502, f"prefill instance {inst.url} returned no kv_transfer_params: is it "
                                  "running a kvconnect connector with kv_role kv_producer or kv_both?")
        ok = True
        return params
    finally:
        up.prefill.release(inst, ok=ok)
        if ok:
            up.metrics.prefill_seconds.observe(time.monotonic() - t0)
