"""The vLLM adapter: our connectors behind vLLM's KVConnectorBase_V1 (the only package importing vLLM).

Three connector names are registered with vLLM's KVConnectorFactory (see `register`):
``KVConnectNixl`` and ``KVConnectMooncake`` (P/D disaggregation, pull mode) and ``KVConnectOffload``
(a host-memory KV tier). `kv_connector_module_path="kvconnect.integrations.vllm"` reaches them
without the plugin.

Modules: `connectors` (the facades vLLM builds), `pd_scheduler`/`pd_worker` and
`offload_scheduler`/`offload_worker` (each connector's two halves), `config` (extra config),
`meta` (scheduler <-> worker messages), `params` (vLLM's kv_transfer_params), `groups` (KV-cache
groups), `stats` (connector stats and stats files), `prom` (our metrics on vLLM's /metrics),
`precheck` (the extra config checked when vLLM first looks a connector up, before any engine starts;
`register` installs it).
"""

from __future__ import annotations

import logging
import os
import threading

from kvconnect.integrations import CONNECTOR_NAMES
from kvconnect.integrations.vllm.connectors import KVConnectMooncake, KVConnectNixl, KVConnectOffload

__all__ = ["KVConnectMooncake", "KVConnectNixl", "KVConnectOffload", "register"]


def _log_to_stderr(level: str | None) -> None:
    """KVCONNECT_LOG_LEVEL=INFO (or DEBUG): kvconnect's own lines, timestamped, in every engine process."""
    if not level:
        return
    logger = logging.getLogger("kvconnect")
    if any(getattr(h, "_kvconnect", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler._kvconnect = True
    handler.setFormatter(logging.Formatter("%(asctime)s kvconnect[%(process)d] %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


_log_to_stderr(os.environ.get("KVCONNECT_LOG_LEVEL"))

_registered = False
_register_lock = threading.Lock()


def register() -> None:
    """Register our connector names and the config precheck with vLLM's KVConnectorFactory; idempotent."""
    global _registered
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvconnect.integrations.vllm import precheck

    with _register_lock:
        if _registered:
            return
        precheck.install(KVConnectorFactory)
        for name in CONNECTOR_NAMES:
            if name in KVConnectorFactory._registry:  # registered by another plugin load in this process
                continue
            try:
                KVConnectorFactory.register_connector(name, __name__, name)
            except ValueError:  # raced with another registration: already there is what we want
                pass
        _registered = True
