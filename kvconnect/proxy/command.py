"""route OpenAI requests through prefill then decode instances (an xPyD router)"""

from __future__ import annotations

import argparse
import logging

from kvconnect.cliargs import UsageError, port, positive_float
from kvconnect.sidechannel.addresses import check_bind


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line options of `kvconnect proxy`."""
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill instance (vLLM server with a kvconnect connector, kv_producer); repeat for more")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode instance (kv_consumer); repeat for more")
    p.add_argument("--mode", choices=["pull", "push"], default="pull",
                   help="pull (default): prefill first, then decode with its params; push: both at once, the "
                        "prefill writes into the decode's blocks (instances need mode \"push\" in their extra config)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--allow-wildcard", action="store_true",
                   help="permit listening on 0.0.0.0 or :: (every interface)")
    p.add_argument("--connect-timeout-s", type=positive_float, default=5.0,
                   help="connecting to an instance, and each health probe")
    p.add_argument("--request-timeout-s", type=positive_float, default=600.0,
                   help="whole-request deadline, prefill and decode together (streams included)")
    p.add_argument("--health-interval-s", type=positive_float, default=5.0, help="seconds between health probes")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="info (default): listen address, instances, state changes, failed requests; debug adds "
                        "one access line per request")


def run(args: argparse.Namespace) -> int:
    """Serve the router until interrupted."""
    try:
        check_bind(args.host, allow_wildcard=args.allow_wildcard, what="the router")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    import uvicorn

    from kvconnect.proxy.app import ProxyConfig, create_app

    try:
        config = ProxyConfig(prefill=args.prefill, decode=args.decode, connect_timeout_s=args.connect_timeout_s,
                             request_timeout_s=args.request_timeout_s, health_interval_s=args.health_interval_s,
                             mode=args.mode)
        app = create_app(config)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("kvconnect.proxy").info("kvconnect proxy: listening on http://%s:%d", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_level == "debug",
                timeout_graceful_shutdown=5)
    return 0
