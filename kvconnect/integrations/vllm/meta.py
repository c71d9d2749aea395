"""What the scheduler-side connector and the worker-side ones tell each other.

vLLM builds one connector in the scheduler process and one per worker; they share no memory. The
scheduler's decisions travel in `KVConnectMeta` (one per step); each worker announces its side
channel once in `KVConnectHandshake`, and reports what the finished sets cannot say (a store that
failed) in `KVConnectWorkerMeta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvconnect import wire

_Struct: Any = dict(frozen=True, kw_only=True)


class HoldOrder(msgspec.Struct, **_Struct):
    """Prefill: this request's prompt is computed; hold its blocks (one list per KV group) under a lease."""

    request_id: str
    block_ids: list[list[int]]
    num_tokens: int
    push_key: str = ""  # push mode: write the blocks into those the decode offers under this key


class OfferOrder(msgspec.Struct, **_Struct):
    """Decode, push mode: offer these blocks to the prefill at host:port (of `tp_size` ranks, rank r at
    port + r) for the request named `key`."""

    request_id: str
    block_ids: list[list[int]]
    num_tokens: int
    key: str
    host: str
    port: int
    tp_size: int = 1
    timeout_s: float | None = None  # the router's shorter deadline for this request (None: load_timeout_s)


class LoadOrder(msgspec.Struct, **_Struct):
    """Decode: pull the blocks `params` name into these local blocks."""

    request_id: str
    block_ids: list[list[int]]
    params: wire.TransferParams
    timeout_s: float | None = None  # the router's shorter deadline for this request (None: load_timeout_s)


class RefusedLoad(msgspec.Struct, **_Struct):
    """Decode: a load whose params the scheduler refused; the worker reports it failed (stage params)."""

    request_id: str
    reason: str


class ReleaseOrder(msgspec.Struct, **_Struct):
    """Decode: the engine already holds every block `params` name; tell the producer to free them."""

    request_id: str
    params: wire.TransferParams


class OffloadLoad(msgspec.Struct, **_Struct):
    """Offload: copy tier slots into these blocks before the forward pass.

    With `request_id`, the load is asynchronous: `fetch_keys` first come up from the lower tiers into
    `slots[fetch_from:]`, then every slot is copied, and the request is reported in finished_recving.
    `invalid_block_ids` found no room to come up into: reported as load errors, so vLLM recomputes them.
    With `fail_request` (a model of several KV-cache groups, whose block-level load errors vLLM does not
    take: it raises), a load that fails or has invalid blocks fails its request instead
    (`failed_recving`): vLLM recomputes it or fails it, by its `kv_load_failure_policy`; `failed` marks
    a load the scheduler already knows cannot be made (the request is failed at once, nothing is copied).
    """

    block_ids: list[int]
    slots: list[int]
    request_id: str = ""
    fetch_keys: list[bytes] = []
    fetch_from: int = 0
    invalid_block_ids: list[int] = []
    keys: list[bytes] = []  # with KVCONNECT_DUMP_DIR (tests): the key of each of `block_ids`
    tokens: int = 0  # prompt tokens vLLM skips computing when the load succeeds (its recompute-time credit)
    fail_request: bool = False
    failed: bool = False


class OffloadStore(msgspec.Struct, **_Struct):
    """Offload: copy a finished request's blocks into these tier slots.

    Without `notify`, `request_id` names a store job of a running request (a boundary state vLLM
    offered): it is reported in the worker meta's `stored`, never in finished_sending, which would
    let vLLM free the request's blocks.
    """

    request_id: str
    block_ids: list[int]
    slots: list[int]
    keys: list[bytes] = []  # with lower tiers (or KVCONNECT_DUMP_DIR): the key of each of `block_ids`
    notify: bool = True


@dataclass
class KVConnectMeta(KVConnectorMetadata):
    """Scheduler -> worker, every step."""

    holds: list[HoldOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    refused: list[RefusedLoad] = field(default_factory=list)
    releases: list[ReleaseOrder] = field(default_factory=list)
    offers: list[OfferOrder] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    offload_loads: list[OffloadLoad] = field(default_factory=list)
    offload_stores: list[OffloadStore] = field(default_factory=list)
    seconds_per_token: float = 0.0  # the engine's measured compute rate (0: none yet), to credit loads with


@dataclass
class KVConnectHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once: where the worker's producer side channel listens."""

    engine_id: str
    host: str
    port: int
    incarnation: str


@dataclass
class KVConnectWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step, what the finished sets cannot say about the offload tier.

    `failed_stores`: stores whose keys must not be published; `failed_fetches`: asynchronous loads
    whose pages did not all come up (their slots are freed); `written_down`: (request, TP rank) pairs
    where the rank is done with the stored slots: its pages reached the lower tiers, or its store
    failed (once every rank is done, the slots may be evicted or freed); `disk_stored` / `disk_gone`: keys
    the disk tier gained and lost (evicted, or missing or corrupt when read); `stored`: (store job, TP
    rank) pairs of the stores without `notify` that ran (their failures are in `failed_stores` too).
    """

    failed_stores: set[str] = field(default_factory=set)
    failed_fetches: set[str] = field(default_factory=set)
    written_down: set[tuple[str, int]] = field(default_factory=set)
    disk_stored: list[bytes] = field(default_factory=list)
    disk_gone: list[bytes] = field(default_factory=list)
    stored: set[tuple[str, int]] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVConnectWorkerMeta):
            self.failed_stores |= other.failed_stores
            self.failed_fetches |= other.failed_fetches
            self.written_down |= other.written_down
            self.stored |= other.stored
            self.disk_stored += other.disk_stored
            self.disk_gone += other.disk_gone
        return self


_RENAMED = {"Hold": "HoldOrder", "Offer": "OfferOrder", "Load": "LoadOrder", "Release": "ReleaseOrder"}


def __getattr__(name: str) -> object:
    if name in _RENAMED:
        raise AttributeError(f"{__name__}.{name} was renamed {_RENAMED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
