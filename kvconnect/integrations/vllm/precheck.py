"""Checking a kvconnect connector's `kv_transfer_config` when vLLM first looks the connector up.

vLLM 0.32 builds connector objects only after the weights are loaded and the KV cache is sized
(the worker's in `initialize_from_config`, the scheduler's in EngineCore after the executor), so a
check in their constructors fails a server a minute after start, once per process. vLLM looks the
connector class up much earlier: `KVConnectorFactory.get_connector_class(kv_transfer_config)`, from
`VllmConfig.__post_init__` in the process that parses the command line, before any engine process
starts. Our plugin wraps that lookup so that a kvconnect connector's config is checked right there.
A bad config then ends `vllm serve` with one line naming the key (`PrecheckFailed`, a SystemExit,
prints its message and no traceback); in a Python program it is a ValueError (`BadExtraConfig`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from kvconnect.integrations import CONNECTOR_NAMES
from kvconnect.integrations.vllm.config import ROLES, OffloadConfig, PDConfig, check_extra

# Each connector's extra-config struct and transport backend.
KINDS: dict[str, tuple[type, str]] = {
    "KVConnectNixl": (PDConfig, "nixl"),
    "KVConnectMooncake": (PDConfig, "mooncake"),
    "KVConnectOffload": (OffloadConfig, ""),
}
assert set(KINDS) == set(CONNECTOR_NAMES), "every registered connector name needs its config kind"


class BadExtraConfig(ValueError):
    """A kvconnect connector's kv_transfer_config that the connector would refuse."""


class PrecheckFailed(SystemExit):
    """The same refusal under a command-line server: one line on stderr and exit status 1, no traceback."""


def check_transfer_config(kv_transfer_config: Any) -> None:
    """BadExtraConfig (one line naming the connector and the key) if a kvconnect connector would refuse it."""
    name = getattr(kv_transfer_config, "kv_connector", None)
    if name not in KINDS:
        return
    kind, backend = KINDS[name]
    role = getattr(kv_transfer_config, "kv_role", None)
    if role not in ROLES:
        raise BadExtraConfig(f"{name}: kv_role must be one of {sorted(ROLES)}, got {role!r}")
    try:
        check_extra(getattr(kv_transfer_config, "kv_connector_extra_config", None), kind, name, backend)
    except ValueError as exc:
        raise BadExtraConfig(str(exc)) from None


def _under_cli() -> bool:
    """Whether this process is a vLLM command-line server (`vllm serve`, the OpenAI api_server module)."""
    argv0 = sys.argv[0] if sys.argv else ""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    return os.path.basename(argv0) == "vllm" or (getattr(main, "name", None) or "").startswith("vllm.entrypoints.")


def install(factory: Any) -> None:
    """Wrap `factory.get_connector_class` so a kvconnect connector's config is checked at lookup; idempotent."""
    current = factory.__dict__["get_connector_class"].__func__
    if getattr(current, "_kvconnect_precheck", False):
        return

    def get_connector_class(cls: Any, kv_transfer_config: Any) -> Any:
        connector_cls = current(cls, kv_transfer_config)
        try:
            check_transfer_config(kv_transfer_config)
        except BadExtraConfig as exc:
            if _under_cli():
                # A SystemExit passes through vLLM's and pydantic's handlers, which would wrap or re-log a ValueError.
                raise PrecheckFailed(f"error: {exc}") from None
            raise
        return connector_cls

    get_connector_class._kvconnect_precheck = True
    get_connector_class.__doc__ = current.__doc__
    factory.get_connector_class = classmethod(get_connector_class)
