"""Every knob of a connector, checked where it is written: `ConnectorConfig`.

Engine adapters fill it from their own configuration; a wrong value fails when the config is built,
with a message naming the field, not when the engine registers its KV cache minutes later.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kvconnect.errors import KVConnectError
from kvconnect.kvgroups import KVGroup
from kvconnect.layout import KVCacheLayout
from kvconnect.shards import PageShards, Segment
from kvconnect.sidechannel.addresses import check_bind, is_wildcard
from kvconnect.transport import BACKENDS, check_transport_options

ROLES = ("producer", "consumer", "both")
_SECONDS = ("lease_s", "load_timeout_s", "handshake_timeout_s", "heartbeat_s")


@dataclass
class ConnectorConfig:
    """Every knob of a connector; engine adapters fill it from their own configuration."""

    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    role: str = "both"
    backend: str = "nixl"
    # Side channel (handshake and control). Loopback unless the operator says otherwise.
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    allow_wildcard: bool = False
    # None: $KVCONNECT_SECRET (read by the side channel), or no authentication.
    secret: str | None = None
    lease_s: float = 30.0
    load_timeout_s: float = 60.0
    handshake_timeout_s: float = 5.0
    heartbeat_s: float = 5.0
    block_size: int = 16
    layout: str = "LBHNC"
    # Tensor parallelism: this worker's rank and the engine's TP size (each rank is one connector).
    rank: int = 0
    world_size: int = 1
    # Per layer name, how its pages split across TP ranks (kvconnect.shards); needed to pair with a
    # peer of another TP size, never between equal sizes.
    shards: Mapping[str, PageShards] | None = None
    # KV-cache groups by layer name (hybrid models); None means one group of every registered layer.
    groups: Sequence[KVGroup] | None = None
    transport_options: dict[str, Any] = field(default_factory=dict)
    # Push mode: decode offers its blocks and prefill writes them (both sides built whatever the role).
    push: bool = False
    group_regions: None = None  # replaced by `groups`; kept only to say so

    def __post_init__(self) -> None:
        if self.group_regions is not None:
            raise KVConnectError("ConnectorConfig(group_regions=...) was replaced by groups=[KVGroup(layers=(...)), ...]"
                                 " naming each group's layers")
        if not isinstance(self.engine_id, str) or not 1 <= len(self.engine_id) <= 256:
            raise KVConnectError(f"engine_id must be a string of 1 to 256 characters, got {self.engine_id!r}")
        if self.role not in ROLES:
            raise KVConnectError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.backend not in BACKENDS:
            raise KVConnectError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        try:
            check_bind(self.host, allow_wildcard=self.allow_wildcard)
        except ValueError as exc:
            raise KVConnectError(str(exc)) from None
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise KVConnectError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.advertise_host is not None and (not isinstance(self.advertise_host, str) or not self.advertise_host
                                                or is_wildcard(self.advertise_host)):
            raise KVConnectError(f"advertise_host must be an address peers can reach, got {self.advertise_host!r}")
        if self.secret is not None and (not isinstance(self.secret, (str, bytes)) or not self.secret):
            raise KVConnectError("secret must be a non-empty string (or None for $KVCONNECT_SECRET)")
        for name in _SECONDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise KVConnectError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise KVConnectError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.layout not in KVCacheLayout.__members__:
            raise KVConnectError(f"layout must be one of {', '.join(KVCacheLayout.__members__)}, got {self.layout!r}")
        if not (isinstance(self.rank, int) and isinstance(self.world_size, int) and 0 <= self.rank < self.world_size):
            raise KVConnectError(f"rank must be in [0, world_size), got rank {self.rank!r}, world_size "
                                 f"{self.world_size!r}")
        if self.shards is not None and not all(isinstance(v, tuple) and v and all(isinstance(x, Segment) for x in v)
                                               for v in self.shards.values()):
            raise KVConnectError("shards must map layer names to non-empty tuples of kvconnect.shards.Segment")
        if not isinstance(self.push, bool):
            raise KVConnectError(f"push must be True or False, got {self.push!r}")
        if self.groups is not None and (not self.groups or not all(isinstance(g, KVGroup) for g in self.groups)):
            raise KVConnectError("groups must be a non-empty list of KVGroup")
        check_transport_options(self.backend, self.transport_options)
