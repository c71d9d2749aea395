"""kvconnect as an SGLang prefill/decode transfer backend, loaded by SGLang's plugin entry point.

`register()` (entry point group `sglang.srt.plugins`) adds `--disaggregation-transfer-backend
kvconnect-mooncake` and `kvconnect-nixl` without editing SGLang: the names join SGLang's choices and
its `TransferBackend` enum, and an AROUND hook on `get_kv_class` hands SGLang this package's classes
for them. SGLang keeps its bootstrap (decode learns where prefill is, both exchange control frames
over its ZMQ sockets); the pages move with kvconnect's pull protocol: the prefill holds a finished
request's pages under a lease, the decode claims and reads them, and the done notice frees them.
"""

from __future__ import annotations

from typing import Any, Callable

# SGLang backend name -> kvconnect transport.
BACKENDS = {"kvconnect-mooncake": "mooncake", "kvconnect-nixl": "nixl"}


def _extend_enum() -> None:
    """Add our names to SGLang's plain `TransferBackend` enum (schedulers call `TransferBackend(name)`)."""
    from sglang.srt.disaggregation.utils import TransferBackend

    for name in BACKENDS:
        if name in TransferBackend._value2member_map_:
            continue
        member = object.__new__(TransferBackend)
        member._name_ = name.upper().replace("-", "_")
        member._value_ = name
        member.__objclass__ = TransferBackend
        TransferBackend._member_map_[member._name_] = member
        TransferBackend._value2member_map_[name] = member
        TransferBackend._member_names_.append(member._name_)
        type.__setattr__(TransferBackend, member._name_, member)


def _around_get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """SGLang's `get_kv_class` for its own backends; ours for `kvconnect-*`."""
    name = getattr(transfer_backend, "value", transfer_backend)
    if name not in BACKENDS or getattr(class_type, "name", "") == "KVARGS":
        return original(transfer_backend, class_type)  # every backend shares SGLang's KVArgs
    from kvconnect.integrations.sglang.conn import classes

    return classes(BACKENDS[name]).get(class_type)


def register() -> None:
    """The `sglang.srt.plugins` entry point: make the kvconnect backends selectable."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    missing = [n for n in BACKENDS if n not in DISAGG_TRANSFER_BACKEND_CHOICES]
    if missing:
        add_disagg_transfer_backend_choices(missing)
    _extend_enum()
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _around_get_kv_class, HookType.AROUND)
