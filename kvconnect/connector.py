"""The public connector: register KV caches once, then hold, pull and report requests' blocks.

`KVConnector` is engine-agnostic; engine adapters translate their hooks onto it. The backend (how
bytes move) is a setting: `NixlConnector` is `KVConnector` with `backend="nixl"`.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.layout import fingerprint
from kvconnect.pd.consumer import Consumer, LoadResults
from kvconnect.pd.producer import Producer
from kvconnect.regions import RegionSet
from kvconnect.transport.base import Transport

ROLES = ("producer", "consumer", "both")


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
    secret: str | None = None
    lease_s: float = 30.0
    load_timeout_s: float = 60.0
    handshake_timeout_s: float = 5.0
    heartbeat_s: float = 5.0
    block_size: int = 16
    layout: str = "LBHNC"
    rank: int = 0
    world_size: int = 1
    # Region indices per KV-cache group (hybrid models); None means one group of every region.
    group_regions: list[list[int]] | None = None
    transport_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise KVConnectError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.secret is None:
            self.secret = os.environ.get("KVCONNECT_SECRET") or None


@dataclass
class Finished:
    """What `KVConnector.get_finished()` reports since its previous call."""

    sending: list[str] = field(default_factory=list)
    recving: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)


def make_transport(backend: str, options: Mapping[str, Any]) -> Transport:
    """The transport for a backend name."""
    if backend == "nixl":
        from kvconnect.transport.nixl import NixlTransport

        return NixlTransport(**options)
    if backend == "mooncake":
        from kvconnect.transport.mooncake import MooncakeTransport

        return MooncakeTransport(**options)
    raise KVConnectError(f"unknown backend {backend!r} (choose nixl or mooncake)")


def _dtype_name(kv_caches: Mapping[str, torch.Tensor]) -> str:
    names = sorted({str(t.dtype).removeprefix("torch.") for t in kv_caches.values()})
    return "+".join(names)[:64]


class KVConnector:
    """Moves a worker's KV blocks to and from peers; one instance per worker process."""

    backend = ""

    def __init__(self, config: ConnectorConfig | None = None, *, transport: Transport | None = None):
        self.config = config or ConnectorConfig()
        if self.backend:
            self.config.backend = self.backend
        self._transport = transport
        self.regions: RegionSet | None = None
        self.metadata: wire.EngineMetadata | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None

    # ---- set-up ----

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> RegionSet:
        """Register the engine's per-layer KV tensors (or one cross-layer tensor) once, after allocation."""
        if self.regions is not None:
            raise KVConnectError("register_kv_caches was already called on this connector")
        cfg = self.config
        regions = RegionSet.from_kv_caches(kv_caches)
        options = dict(cfg.transport_options)
        if cfg.backend == "nixl" and cfg.role == "consumer":
            # A consumer only initiates and its worker polls: NIXL's progress thread would only burn a core.
            options.setdefault("progress_thread", False)
        if cfg.backend == "mooncake" and cfg.role in ("producer", "both"):
            # Mooncake advertises the host it was started on: peers on other hosts must be able to reach
            # it, so default to the side channel's public address rather than loopback.
            public = cfg.advertise_host or (None if cfg.host in ("0.0.0.0", "::", "") else cfg.host)
            if public:
                options.setdefault("host", public)
        transport = self._transport or make_transport(cfg.backend, options)
        transport.register(regions)
        self._transport, self.regions = transport, regions
        dtype = _dtype_name(kv_caches)
        self.metadata = wire.EngineMetadata(
            engine_id=cfg.engine_id, incarnation=wire.process_incarnation(), rank=cfg.rank,
            world_size=cfg.world_size, transport=transport.name, transport_metadata=transport.local_metadata(),
            regions=wire.regions_to_wire(regions), block_size=cfg.block_size, layout=cfg.layout, dtype=dtype,
            layout_fingerprint=fingerprint(layout=cfg.layout, block_size=cfg.block_size, dtype=dtype,
                                           geometry=regions.geometry_fingerprint()),
        )
        if cfg.role in ("producer", "both"):
            self.producer = Producer(
                metadata=self.metadata, regions=regions, group_regions=cfg.group_regions, host=cfg.host,
                port=cfg.port, advertise_host=cfg.advertise_host, secret=cfg.secret,
                allow_wildcard=cfg.allow_wildcard, lease_s=cfg.lease_s)
        if cfg.role in ("consumer", "both"):
            self.consumer = Consumer(
                engine_id=cfg.engine_id, transport=transport, regions=regions, expect=self.metadata.compat(),
                group_regions=cfg.group_regions, rank=cfg.rank, secret=cfg.secret,
                load_timeout_s=cfg.load_timeout_s, handshake_timeout_s=cfg.handshake_timeout_s,
                heartbeat_s=cfg.heartbeat_s)
        return regions

    @property
    def transport(self) -> Transport:
        """The registered transport."""
        if self._transport is None or self.regions is None:
            raise KVConnectError("call register_kv_caches first")
        return self._transport

    @property
    def side_channel(self) -> tuple[str, int]:
        """(host, port) consumers reach this producer on."""
        p = self._producer()
        return p.host, p.port

    # ---- request lifecycle ----

    def request_finished(self, request_id: str, block_ids: Sequence[Sequence[int]],
                         num_tokens: int) -> wire.TransferParams:
        """Producer: hold a finished prefill's blocks (one id list per KV group); returns its transfer params."""
        return self._producer().hold(request_id, block_ids, num_tokens)

    def start_load(self, request_id: str, local_block_ids: Sequence[Sequence[int]],
                   params: wire.TransferParams | Mapping[str, Any], timeout_s: float | None = None) -> None:
        """Consumer: pull a request's blocks into local block ids (a shorter local list pulls the suffix)."""
        if not isinstance(params, wire.TransferParams):
            params = wire.transfer_params_from_builtins(params)
        self._consumer().load(request_id, local_block_ids, params, timeout_s)

    def abort(self, request_id: str) -> None:
        """Give up on a request on either side: a held lease is released, a pending load fails."""
        if self.producer is not None:
            self.producer.abort(request_id)
        if self.consumer is not None:
            self.consumer.abort(request_id)

    def get_finished(self) -> Finished:
        """Requests whose blocks were released (sending) or whose loads ended (recving, failed included)."""
        out = Finished()
        if self.producer is not None:
            out.sending = [r.request_id for r in self.producer.poll()]
        if self.consumer is not None:
            res: LoadResults = self.consumer.poll()
            out.recving = res.finished + list(res.failed)
            out.failed = res.failed
            out.invalid_block_ids = res.invalid_blocks()
        return out

    @property
    def held_blocks(self) -> int:
        """Blocks held under producer leases."""
        return 0 if self.producer is None else self.producer.held_blocks

    # ---- shutdown ----

    def close(self) -> None:
        """Stop the side channel and the consumer, then close the transport in order."""
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.close()
        if self._transport is not None:
            self._transport.close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _producer(self) -> Producer:
        if self.producer is None:
            raise KVConnectError(f"connector role {self.config.role!r} has no producer side (or not registered)")
        return self.producer

    def _consumer(self) -> Consumer:
        if self.consumer is None:
            raise KVConnectError(f"connector role {self.config.role!r} has no consumer side (or not registered)")
        return self.consumer


class NixlConnector(KVConnector):
    """KVConnector moving blocks with NIXL (UCX by default)."""

    backend = "nixl"


class MooncakeConnector(KVConnector):
    """KVConnector moving blocks with the Mooncake Transfer Engine (tcp here, rdma on RDMA hosts)."""

    backend = "mooncake"
