"""Engine adapters. Each module here is the only place that imports its engine.

`kvconnect.integrations.vllm` implements vLLM's KVConnectorBase_V1 on our core and registers the
connector names KVConnectNixl, KVConnectMooncake and KVConnectOffload (see `register_vllm`).
"""

CONNECTOR_NAMES = ("KVConnectNixl", "KVConnectMooncake", "KVConnectOffload")


def register_vllm() -> None:
    """Entry point of group `vllm.general_plugins`: registers our connector names, idempotently."""
    from kvconnect.integrations.vllm import register

    register()
