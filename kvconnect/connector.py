"""The public connector: register KV caches once, then hold, pull and report requests' blocks.

`KVConnector` is engine-agnostic; engine adapters translate their hooks onto it. The backend (how
bytes move) is a setting: `NixlConnector` is `KVConnector` with `backend="nixl"`. `ConnectorConfig`
(`kvconnect.config`) checks every field when it is built, so a wrong setting fails where it is written.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from kvconnect import wire
from kvconnect.compat import layers_digest
from kvconnect.config import ConnectorConfig
from kvconnect.errors import KVConnectError
from kvconnect.kvgroups import KVGroup, resolve_groups
from kvconnect.pd.consumer import Consumer
from kvconnect.pd.failure import LoadFailure
from kvconnect.pd.fence import Fence
from kvconnect.pd.keeper import LeaseKeeper
from kvconnect.pd.producer import Producer
from kvconnect.pd.push_role import PushRole
from kvconnect.pd.pusher import Pusher
from kvconnect.regions import RegionSet
from kvconnect.shards import check_page, global_bytes
from kvconnect.sidechannel.addresses import is_wildcard
from kvconnect.threads import unpinned
from kvconnect.transport import Transport, make_transport

@dataclass
class Finished:
    """What `KVConnector.get_finished()` reports since its previous call.

    `sending`: producer requests whose blocks are free again; `loaded`: loads (by handle) whose every
    byte landed; `failed`: loads that failed, each with its LoadFailure (stage and reason);
    `invalid_block_ids`: the local blocks of the failed loads. In push mode a decode's pushes are
    reported as loads (loaded or failed) and a prefill's in `sending` once they ended, failures also
    in `push_failed`.
    """

    sending: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    failed: dict[str, LoadFailure] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)
    push_failed: dict[str, str] = field(default_factory=dict)

    @property
    def recving(self) -> list[str]:
        """Gone: finished and failed loads are reported apart."""
        raise AttributeError("Finished.recving was split into Finished.loaded (loads that finished) and "
                             "Finished.failed (loads that failed, with their LoadFailure)")


def _dtype_name(kv_caches: Mapping[str, torch.Tensor]) -> str:
    names = sorted({str(t.dtype).removeprefix("torch.") for t in kv_caches.values()})
    return "+".join(names)[:64]


class KVConnector:
    """Moves a worker's KV blocks to and from peers; one instance per worker process."""

    backend = ""

    def __init__(self, config: ConnectorConfig | None = None, *, transport: Transport | None = None):
        config = config or ConnectorConfig()
        self.config = dataclasses.replace(config, backend=self.backend) if self.backend else config
        self._transport = transport
        self.regions: RegionSet | None = None
        self.group_regions: list[list[int]] = []
        self.metadata: wire.EngineMetadata | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.push_role: PushRole | None = None
        self._keeper: LeaseKeeper | None = None

    # ---- set-up ----

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> RegionSet:
        """Register the engine's per-layer KV tensors (or one cross-layer tensor) once, after allocation."""
        if self.regions is not None:
            raise KVConnectError("register_kv_caches was already called on this connector")
        cfg = self.config
        layers = [g.layers for g in cfg.groups] if cfg.groups else [tuple(kv_caches)]
        regions = RegionSet.from_kv_caches(kv_caches, layer_groups=layers, shards=cfg.shards)
        for r in regions:
            for split in r.splits:
                if split is not None:
                    check_page(split, cfg.world_size, r.block_bytes, f"region {r.label}")
        group_regions = resolve_groups(regions, cfg.groups)
        # Per layer, the bytes of one block as a TP-1 engine would hold them: what peers of any TP size compare.
        self._page_bytes = {name: global_bytes((cfg.shards or {}).get(name), math.prod(t.shape[1:]) * t.element_size(),
                                               cfg.world_size) for name, t in kv_caches.items()}
        # In a thread free of the engine's CPU binding: the libraries' threads started here inherit it.
        transport = unpinned(lambda: self._register(regions))
        self._transport, self.regions, self.group_regions = transport, regions, group_regions
        self.metadata = self._metadata(transport, regions, _dtype_name(kv_caches))
        if cfg.role in ("consumer", "both") or cfg.push:
            self.consumer = Consumer(engine_id=cfg.engine_id, transport=transport, regions=regions,
                                     expect=self.metadata.compat, group_regions=group_regions, rank=cfg.rank,
                                     world_size=cfg.world_size, secret=cfg.secret, load_timeout_s=cfg.load_timeout_s,
                                     handshake_timeout_s=cfg.handshake_timeout_s)
        pusher = Pusher(self.consumer, wait_s=cfg.lease_s) if cfg.push else None
        if cfg.role in ("producer", "both") or cfg.push:
            self.producer = unpinned(lambda: Producer(
                metadata=self.metadata, regions=regions, host=cfg.host, port=cfg.port,
                advertise_host=cfg.advertise_host, secret=cfg.secret, allow_wildcard=cfg.allow_wildcard,
                lease_s=cfg.lease_s, on_offer=pusher.offer if pusher else None))
        if pusher is not None:
            self.push_role = PushRole(
                consumer=self.consumer, producer=self.producer, pusher=pusher, regions=regions,
                group_regions=group_regions, engine_id=cfg.engine_id, rank=cfg.rank, world_size=cfg.world_size,
                secret=cfg.secret, timeout_s=cfg.handshake_timeout_s, load_timeout_s=cfg.load_timeout_s)
        return regions

    def _register(self, regions: RegionSet) -> Transport:
        transport = self._transport or make_transport(self.config.backend, self._transport_options())
        transport.register(regions)
        return transport

    def _transport_options(self) -> dict[str, Any]:
        cfg = self.config
        options = dict(cfg.transport_options)
        if cfg.backend == "nixl" and cfg.role == "consumer" and not cfg.push:
            # A pull consumer only initiates and its peer workers poll: nothing else needs progress here
            # (a push decode is written into, which UCX over TCP only completes with progress on this side).
            options.setdefault("progress_interval_s", 0.0)
        if cfg.backend == "mooncake" and cfg.role in ("producer", "both"):
            # Mooncake advertises the host it was started on: peers on other hosts must be able to reach
            # it, so default to the side channel's public address rather than loopback.
            public = cfg.advertise_host or (None if is_wildcard(cfg.host) else cfg.host)
            if public:
                options.setdefault("host", public)
        return options

    def _metadata(self, transport: Transport, regions: RegionSet, dtype: str) -> wire.EngineMetadata:
        cfg = self.config
        groups = cfg.groups or [KVGroup(layers=tuple(self._page_bytes))]
        # Per layer, the bytes of one block as the engine registered it: a Mamba layer's state bytes, not
        # the page it shares with an attention layer, so a different state layout is caught by name.
        compat = wire.Compat(transport=transport.name, layout=cfg.layout, dtype=dtype, block_size=cfg.block_size,
                             groups=tuple(wire.GroupCompat(
                                 label=g.label, block_size=g.block_size or cfg.block_size,
                                 page_bytes=tuple(self._page_bytes[name] for name in g.layers),
                                 layers=layers_digest([g.layers])) for g in groups))
        return wire.EngineMetadata(
            engine_id=cfg.engine_id, incarnation=wire.process_incarnation(), rank=cfg.rank, world_size=cfg.world_size,
            transport=transport.name, transport_metadata=transport.local_metadata(),
            regions=regions.to_wire(), group_regions=tuple(tuple(g) for g in self.group_regions),
            block_size=cfg.block_size, layout=cfg.layout, dtype=dtype, compat=compat)

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

    def hold_blocks(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int) -> None:
        """Producer: `request_finished` for an engine that builds the transfer params itself (none built here)."""
        self._producer().hold_lease(request_id, block_ids, num_tokens)

    def start_load(self, params: wire.TransferParams | Mapping[str, Any], local_block_ids: Sequence[Sequence[int]],
                   *args: Any, handle: str | None = None, timeout_s: float | None = None,
                   decoded: bool = False) -> str:
        """Consumer: pull the blocks `params` name into local block ids (a shorter local list pulls the suffix).

        `params`: a mapping is parsed, a `TransferParams` checked, one `decoded` by kvconnect's parsers
        taken as is (an engine adapter that parsed them at its edge: they are checked once).
        The load reads, and then releases, the producer's lease `params.request_id`; `handle` (default:
        that same id) is the engine's name for it in `get_finished()` and `abort()`. Returns the handle.
        """
        if isinstance(params, str) or args:
            raise TypeError("start_load(request_id, local_block_ids, params) is now start_load(params, "
                            "local_block_ids, handle=...): the lease read is params.request_id, and the engine's own "
                            "id, if it differs, goes in handle=")
        params = parsed(params, decoded)
        if self._keeper is not None:
            self._keeper.untrack(params.request_id)
        return self._consumer().load(params, local_block_ids, handle=handle, timeout_s=timeout_s)

    def release_remote(self, params: wire.TransferParams | Mapping[str, Any], decoded: bool = False) -> None:
        """Consumer: tell the producer to free a request's blocks without reading them (no handshake)."""
        self._consumer().release(parsed(params, decoded))

    def keep_alive(self, params: wire.TransferParams | Mapping[str, Any]) -> None:
        """Consumer: heartbeat the producer's lease until `start_load` (or `release_remote`) for it."""
        params = parsed(params)
        consumer = self._consumer()
        if self._keeper is None:
            cfg = self.config
            self._keeper = LeaseKeeper(engine_id=cfg.engine_id, rank=cfg.rank, secret=cfg.secret,
                                       heartbeat_s=cfg.heartbeat_s, timeout_s=consumer.handshake_timeout_s)
        self._keeper.track(params)

    def expect_push(self, key: str, prefill: tuple[str, int], local_block_ids: Sequence[Sequence[int]],
                    num_tokens: int, *, handle: str, timeout_s: float | None = None) -> None:
        """Push-mode decode: `push_role.expect` (offer these blocks to the prefill at (host, port) for `key`)."""
        self._push_role().expect(key, prefill, local_block_ids, num_tokens, handle=handle, timeout_s=timeout_s)

    def push(self, key: str, block_ids: Sequence[Sequence[int]], *, handle: str, timeout_s: float | None = None,
             layerwise: bool = False, fence: Fence | None = None) -> None:
        """Push-mode prefill: `push_role.push` (write these blocks into those the decode offers for `key`)."""
        self._push_role().push(key, block_ids, handle=handle, timeout_s=timeout_s, layerwise=layerwise, fence=fence)

    def layers_saved(self, names: Sequence[str], fence: Fence | None = None) -> int:
        """Layer-wise push: `push_role.layers_saved` (0 without push mode)."""
        return 0 if self.push_role is None else self.push_role.layers_saved(names, fence)

    def forward_done(self, fence: Fence | None = None) -> None:
        """Layer-wise push: `push_role.forward_done`."""
        if self.push_role is not None:
            self.push_role.forward_done(fence)

    pusher = property(lambda self: self.push_role and self.push_role.pusher, doc="`push_role.pusher`, or None.")
    offers = property(lambda self: self.push_role and self.push_role.offers, doc="`push_role.offers`, or None.")

    def abort(self, request_id: str) -> None:
        """Give up on a request on either side: a held lease is released, a pending load or push fails."""
        if self.producer is not None:
            self.producer.abort(request_id)
        if self.consumer is not None:
            self.consumer.abort(request_id)
        if self.push_role is not None:
            self.push_role.abort(request_id)

    def get_finished(self) -> Finished:
        """Requests whose blocks were released (sending) and loads that finished or failed."""
        out, push = Finished(), self.push_role
        if self.producer is not None:
            ends = self.producer.poll()
            if push is not None:
                ends = push.take_offers(ends, out.loaded, out.failed, out.invalid_block_ids)
            out.sending = [e.request_id for e in ends]
        if self.consumer is not None:
            res = self.consumer.poll()
            if push is not None:
                pushes = push.take_pushes(res)
                out.sending += pushes.pushed + list(pushes.failed)
                out.push_failed = pushes.failed
            out.loaded += res.loaded
            out.failed.update(res.failed)
            out.invalid_block_ids |= res.invalid_block_ids
        return out

    @property
    def held_blocks(self) -> int:
        """Blocks held under producer leases."""
        return 0 if self.producer is None else self.producer.held_blocks

    # ---- shutdown ----

    def close(self) -> None:
        """Stop the side channel and the consumer, then close the transport in order."""
        if self._keeper is not None:
            self._keeper.close()
        if self.push_role is not None:
            self.push_role.close()
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

    def _push_role(self) -> PushRole:
        if self.push_role is None:
            raise KVConnectError("push mode is off for this connector (ConnectorConfig(push=True))")
        return self.push_role

    def _consumer(self) -> Consumer:
        if self.consumer is None:
            raise KVConnectError(f"connector role {self.config.role!r} has no consumer side (or not registered)")
        return self.consumer


def parsed(params: wire.TransferParams | Mapping[str, Any], decoded: bool = False) -> wire.TransferParams:
    """Transfer params as a checked struct (WireError otherwise): a mapping is parsed, a struct built in
    Python is checked (msgspec checks what it decodes, not a constructor's arguments), and a struct
    `decoded` by kvconnect's own parsers (`from_vllm`, `transfer_params_from_builtins`) is taken as is."""
    if isinstance(params, wire.TransferParams) and decoded:
        return params
    return wire.checked_params(dict(params) if isinstance(params, Mapping) else params)


class NixlConnector(KVConnector):
    """KVConnector moving blocks with NIXL (UCX by default)."""

    backend = "nixl"


class MooncakeConnector(KVConnector):
    """KVConnector moving blocks with the Mooncake Transfer Engine (tcp here, rdma on RDMA hosts)."""

    backend = "mooncake"
