"""Each backend's options as a typed struct, checked without importing the backend: the one home of their defaults.

`check_transport_options("nixl", {"backends": ["UCX"]})` refuses unknown keys and wrong types with
a message naming the key, so a configuration error shows when the configuration is read, not when
the engine registers its KV cache minutes later. The backends take their constructor defaults from
these structs; `kvconnect.transport.make_transport` builds a transport by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Mapping

import msgspec
from msgspec import Meta

from kvconnect.errors import KVConnectError

# Blocks of a NIXL peer prepared up front: 24 bytes of numpy plus about 8 of NIXL per block, 64 MiB in all.
DEFAULT_PREPARED_ROWS = 2 << 20
# Entries a Mooncake TCP peer connection queues without an admission wait (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER).
DEFAULT_MAX_BATCH_ENTRIES = 1024

_Options: Any = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)
_Name = Annotated[str, Meta(min_length=1, max_length=128)]
MOONCAKE_PROTOCOLS = ("tcp", "rdma", "efa", "nvlink", "nvlink_intra", "hip")


class NixlOptions(msgspec.Struct, **_Options):
    """Keyword arguments of `NixlTransport`."""

    agent_name: _Name | None = None
    backends: Annotated[tuple[_Name, ...], Meta(min_length=1)] = ("UCX",)
    num_threads: Annotated[int, Meta(ge=0, le=256)] = 4
    progress_thread: bool = False
    progress_interval_s: Annotated[float, Meta(ge=0, le=1)] = 0.0005
    prepared_rows: Annotated[int, Meta(ge=0)] = DEFAULT_PREPARED_ROWS


class MooncakeOptions(msgspec.Struct, **_Options):
    """Keyword arguments of `MooncakeTransport`."""

    host: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]+$")] = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    max_batch_entries: Annotated[int, Meta(ge=1)] = DEFAULT_MAX_BATCH_ENTRIES
    close_timeout_s: Annotated[float, Meta(gt=0)] = 30.0


BACKENDS: dict[str, type[msgspec.Struct]] = {"nixl": NixlOptions, "mooncake": MooncakeOptions}


def check_transport_options(backend: str, options: Mapping[str, Any]) -> msgspec.Struct:
    """The options of `backend` as its struct; KVConnectError naming the backend, key and problem."""
    if backend not in BACKENDS:
        raise KVConnectError(f"unknown backend {backend!r} (choose one of {', '.join(BACKENDS)})")
    if not isinstance(options, Mapping):
        raise KVConnectError(f"transport_options must be a mapping, got {type(options).__name__}")
    try:
        parsed = msgspec.convert(dict(options), BACKENDS[backend], strict=True)
    except msgspec.ValidationError as exc:
        allowed = ", ".join(BACKENDS[backend].__struct_fields__)
        raise KVConnectError(f"{backend} transport_options: {exc} (keys: {allowed})") from None
    if isinstance(parsed, MooncakeOptions) and parsed.protocol not in MOONCAKE_PROTOCOLS:
        raise KVConnectError(f"mooncake transport_options: protocol {parsed.protocol!r} is not one of "
                             f"{', '.join(MOONCAKE_PROTOCOLS)}")
    return parsed


def __getattr__(name: str) -> object:
    """Names that moved out of this module fail with a message naming their new home."""
    if name == "make_transport":
        raise ImportError("kvconnect.transport.options.make_transport moved to kvconnect.transport.make_transport")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
