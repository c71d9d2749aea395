"""`kv_connector_extra_config` of our vLLM connectors, as typed structs checked when vLLM builds them.

Unknown keys, wrong types, non-positive durations and transport options the backend does not take
are one-line errors naming the connector and the key: raised when vLLM first looks the connector up,
before any engine starts (`precheck`), and again when it builds the connector.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvconnect.errors import KVConnectError
from kvconnect.sidechannel.addresses import check_bind
from kvconnect.transport import check_transport_options

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_Seconds = Annotated[float, Meta(gt=0, le=86400)]
_Path = Annotated[str, Meta(min_length=1)]
_Struct: Any = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)

ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}
# Keys that were renamed: the old spelling fails with the new name.
RENAMED = {"load_deadline_s": "load_timeout_s"}


class PDConfig(msgspec.Struct, **_Struct):
    """Extra config of KVConnectNixl and KVConnectMooncake."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    advertise_host: str | None = None
    allow_wildcard: bool = False
    secret: Annotated[str, Meta(min_length=1)] | None = None
    lease_s: _Seconds = 30.0
    load_timeout_s: _Seconds = 60.0
    handshake_timeout_s: _Seconds = 5.0
    heartbeat_s: _Seconds = 5.0
    transport_options: dict[str, Any] = {}
    stats_path: _Path | None = None
    # "push": also serve requests a router sends in push mode (decode offers, prefill writes).
    mode: Literal["pull", "push"] = "pull"
    # Push mode, prefill side: write each layer's KV while the forward pass computes the next.
    layerwise: bool = False


class DiskTierConfig(msgspec.Struct, tag="disk", tag_field="kind", **_Struct):
    """`{"kind": "disk", "path": ..., "max_gib": ...}`: a local-disk tier below the host pool."""

    path: _Path
    max_gib: Annotated[float, Meta(gt=0)] = 10.0


class StoreTierConfig(msgspec.Struct, tag="store", tag_field="kind", **_Struct):
    """`{"kind": "store", "master": "host:port", ...}`: Mooncake Store as the cluster-wide tier."""

    master: Annotated[str, Meta(pattern=r"^\[?[^\s/]+\]?:[0-9]{1,5}$")]
    protocol: Literal["tcp", "rdma"] = "tcp"
    local_host: str = "127.0.0.1"
    device: str = ""
    retry_s: _Seconds = 10.0
    # A get that the store has not answered by then is abandoned and its pages are misses (a stalled store).
    get_timeout_s: _Seconds = 5.0


TierConfig = DiskTierConfig | StoreTierConfig


class OffloadConfig(msgspec.Struct, **_Struct):
    """Extra config of KVConnectOffload."""

    cpu_bytes: Annotated[int, Meta(gt=0)] | None = None
    cpu_gib: Annotated[float, Meta(gt=0)] | None = None
    policy: Literal["lru", "arc"] = "lru"
    salt: str = ""
    timeout_s: _Seconds = 60.0
    stats_path: _Path | None = None
    tiers: list[TierConfig] = []

    @property
    def capacity_bytes(self) -> int:
        """The tier's size in bytes (1 GiB when neither key is given)."""
        if self.cpu_bytes is not None:
            return self.cpu_bytes
        return int((1.0 if self.cpu_gib is None else self.cpu_gib) * (1 << 30))


def read_extra(vllm_config: VllmConfig, kind: type[msgspec.Struct], connector: str, backend: str = "") -> Any:
    """The connector's extra config as `kind`; ValueError naming the connector and the key otherwise."""
    return check_extra(vllm_config.kv_transfer_config.kv_connector_extra_config, kind, connector, backend)


def check_extra(extra: dict[str, Any] | None, kind: type[msgspec.Struct], connector: str, backend: str = "") -> Any:
    """`extra` (a kv_connector_extra_config) as `kind`; a one-line ValueError naming the connector and the key."""
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValueError(f"{connector}: kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
    extra = dict(extra)
    for old, new in RENAMED.items():
        if old in extra:
            raise ValueError(f"{connector}: kv_connector_extra_config[{old!r}] was renamed {new!r}")
    try:
        cfg = msgspec.convert(extra, kind, strict=True)
    except msgspec.ValidationError as exc:
        keys = ", ".join(kind.__struct_fields__)
        raise ValueError(f"{connector}: kv_connector_extra_config{_where(str(exc))} (keys: {keys})") from None
    try:
        if isinstance(cfg, PDConfig):
            if cfg.layerwise and cfg.mode != "push":
                raise ValueError('layerwise streams push-mode WRITEs: it needs "mode": "push"')
            check_bind(cfg.host, allow_wildcard=cfg.allow_wildcard)
            check_transport_options(backend, cfg.transport_options)
        elif cfg.cpu_bytes is not None and cfg.cpu_gib is not None:
            raise ValueError("give cpu_bytes or cpu_gib, not both")
        elif len({type(t) for t in cfg.tiers}) != len(cfg.tiers):
            raise ValueError("tiers: each kind (disk, store) at most once")
    except (ValueError, KVConnectError) as exc:
        raise ValueError(f"{connector}: kv_connector_extra_config: {exc}") from None
    return cfg


def _where(msg: str) -> str:
    """msgspec's message with the key in front: "['port']: Expected `int`, got `str`", ": unknown field `lease`"."""
    m = re.fullmatch(r"(.*?)(?: - at `\$(.*)`)?", msg)
    what, path = m.group(1), re.sub(r"\.([A-Za-z_]\w*)", r"['\1']", m.group(2) or "")
    unknown = re.fullmatch(r"Object contains unknown field `([^`]*)`", what)
    return f"{path}: unknown field `{unknown.group(1)}`" if unknown else f"{path}: {what}"


def kv_role(vllm_config: VllmConfig, connector: str) -> str:
    """Our role for vLLM's kv_role; ValueError for anything else."""
    role = vllm_config.kv_transfer_config.kv_role
    if role not in ROLES:
        raise ValueError(f"{connector}: kv_role must be one of {sorted(ROLES)}, got {role!r}")
    return ROLES[role]
