"""Host addresses as the side channel, the connector and the router read them: one set of rules.

Pure string and socket checks, no ZMQ. A wildcard address (every interface) is never bound unless the
caller opts in; `is_local` tells whether an address belongs to this host (by binding it), which a
plain string comparison cannot.
"""

from __future__ import annotations

import ipaddress
import socket

# The setting is `allow_wildcard` wherever check_bind is reached: ConnectorConfig, SideChannelServer,
# Producer, and the vLLM connectors' kv_connector_extra_config. `kvconnect proxy` has its own flag
# and its own message.
WILDCARD_HINT = "set allow_wildcard to true to listen on every interface"


def strip_brackets(host: str) -> str:
    """`[::1]` as `::1`; anything else unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_wildcard(host: str) -> bool:
    """Whether `host` means every interface (`0.0.0.0`, `::`, `*` or empty)."""
    bare = strip_brackets(host)
    if bare in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`)."""
    bare = strip_brackets(host)
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def is_ipv6(host: str) -> bool:
    """Whether `host` is written as an IPv6 address."""
    return ":" in strip_brackets(host)


def zmq_endpoint(host: str, port: int | str) -> str:
    """The ZMQ TCP endpoint of a host and port (`*` as the port lets ZMQ pick one)."""
    bare = strip_brackets(host)
    return f"tcp://[{bare}]:{port}" if is_ipv6(bare) else f"tcp://{bare}:{port}"


def check_bind(host: str, *, allow_wildcard: bool, what: str = "the side channel") -> None:
    """Refuse to bind a wildcard address without an explicit opt-in (ValueError naming the address)."""
    if not isinstance(host, str):
        raise ValueError(f"{what}: host must be a string, got {type(host).__name__}")
    if is_wildcard(host) and not allow_wildcard:
        raise ValueError(f"refusing to bind {what} to the wildcard address {host!r}; {WILDCARD_HINT}")


def is_local(host: str) -> bool:
    """Whether this host can bind `host` (a wildcard counts as local): a name that does not resolve,
    or an address of another machine, is not."""
    if is_wildcard(host):
        return True
    bare = strip_brackets(host)
    family = socket.AF_INET6 if is_ipv6(bare) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((bare, 0))
    except OSError:
        return False
    return True
