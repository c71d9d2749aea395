"""route OpenAI requests through prefill then decode instances (an xPyD router)"""

from __future__ import annotations

import argparse
import errno
import logging
import socket

from kvconnect.cliargs import UsageError, port, positive_float
from kvconnect.sidechannel.addresses import is_ipv6, is_wildcard, strip_brackets


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
                        "one access line per request and httpx's line per call to an instance")


def address(host: str, port_: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    bare = strip_brackets(host)
    return f"[{bare}]:{port_}" if is_ipv6(bare) else f"{bare}:{port_}"


def listen_socket(host: str, port_: int) -> socket.socket:
    """The router's bound socket; UsageError naming the flag and the address when this host cannot listen there."""
    bare, shown = strip_brackets(host), address(host, port_)
    # The family from the address's spelling, as uvicorn picks it: `localhost` listens on 127.0.0.1.
    sock = socket.socket(socket.AF_INET6 if is_ipv6(bare) else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind(("" if bare == "*" else bare, port_))
    except OSError as exc:  # socket.gaierror included: a name that does not resolve
        sock.close()
        flag = "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
        raise UsageError(f"{flag}: cannot listen on {shown}: {exc.strerror or exc}") from None
    return sock


def configure_logging(level: str) -> None:
    """Root logging at `level`; httpx's line per call to an instance (every health probe) only at debug."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


def run(args: argparse.Namespace) -> int:
    """Serve the router until interrupted."""
    if is_wildcard(args.host) and not args.allow_wildcard:
        raise UsageError(f"--host: refusing to listen on the wildcard address {args.host!r} (every interface); "
                         "pass --allow-wildcard to permit it")
    import uvicorn

    from kvconnect.proxy.app import ProxyConfig, create_app

    try:
        config = ProxyConfig(prefill=args.prefill, decode=args.decode, connect_timeout_s=args.connect_timeout_s,
                             request_timeout_s=args.request_timeout_s, health_interval_s=args.health_interval_s,
                             mode=args.mode)
        app = create_app(config)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sock = listen_socket(args.host, args.port)  # bound before anything is logged or probed
    configure_logging(args.log_level)
    logging.getLogger("kvconnect.proxy").info("kvconnect proxy: listening on http://%s", address(args.host, args.port))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=args.log_level == "debug", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
