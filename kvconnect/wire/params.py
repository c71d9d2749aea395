"""Transfer parameters: what a producer hands out for one request so that a consumer can pull its
blocks, and their plain-object form for frontends that carry them inside JSON; and the per-request
load deadline a router may add beside them (`LOAD_TIMEOUT_KEY`)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from kvconnect.wire.limits import (
    DECODE_ERRORS, MAX_BLOCKS_PER_GROUP, MAX_KV_GROUPS, MAX_TP, STRUCT_CONFIG, BlockId, EngineId, Host, Incarnation,
    NonNegative, Port, RequestId, UnixTime, WireError,
)


class RankAddr(Struct, array_like=True, **STRUCT_CONFIG):
    """Where one TP rank of a producer answers, and the incarnation its blocks were held under."""

    host: Host
    port: Port
    incarnation: Incarnation


class TransferParams(Struct, **STRUCT_CONFIG):
    """What a producer hands out for one request so that a consumer can pull its KV blocks."""

    engine_id: EngineId
    host: Host
    port: Port
    request_id: RequestId
    # One list of block ids per KV-cache group.
    block_ids: Annotated[
        list[Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS_PER_GROUP)]],
        Meta(min_length=1, max_length=MAX_KV_GROUPS),
    ]
    num_tokens: NonNegative
    # Unix seconds after which the producer may free the blocks (advice: heartbeats extend it).
    lease_expiry: UnixTime
    incarnation: Incarnation
    # Every TP rank of the producer, rank 0 first; empty for a producer of one rank (host/port above).
    ranks: Annotated[tuple[RankAddr, ...], Meta(max_length=MAX_TP)] = ()

    def __post_init__(self) -> None:
        if self.ranks and (self.ranks[0].host, self.ranks[0].port, self.ranks[0].incarnation) != \
                (self.host, self.port, self.incarnation):
            raise ValueError("ranks[0] must be the host, port and incarnation the params name")

    @property
    def tp_size(self) -> int:
        """How many TP ranks hold the request (each holds its shard of every block)."""
        return max(len(self.ranks), 1)

    def rank(self, rank: int) -> RankAddr:
        """Where producer rank `rank` answers."""
        return self.ranks[rank] if self.ranks else RankAddr(host=self.host, port=self.port, incarnation=self.incarnation)


def transfer_params_to_builtins(params: TransferParams) -> dict[str, Any]:
    """Transfer parameters as a plain dict, for frontends that carry them inside JSON."""
    return msgspec.to_builtins(params)


def transfer_params_from_builtins(obj: object) -> TransferParams:
    """Validate transfer parameters that arrived as plain objects (e.g. parsed JSON); raises WireError."""
    try:
        return msgspec.convert(obj, TransferParams, strict=True)
    except (msgspec.ValidationError, *DECODE_ERRORS) as exc:
        raise WireError(f"malformed transfer parameters: {exc}") from None


# A router's per-request load deadline, in seconds, beside the transfer params of a decode request.
LOAD_TIMEOUT_KEY = "kvconnect_load_timeout_s"


def load_timeout_from_builtins(value: object, limit_s: float) -> float:
    """A router's per-request load deadline (plain JSON seconds) capped at `limit_s`; raises WireError."""
    # bool is an int to Python; a router sending `true` made a mistake, not a one-second deadline. NaN is
    # not > 0; an int is finite however large (and too large for float(): compared as it is).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or (isinstance(value, float) and not math.isfinite(value)):
        raise WireError(f"{LOAD_TIMEOUT_KEY} must be a positive, finite number of seconds, got {value!r}")
    # Only shortens: the operator's load_timeout_s bounds how long a decode holds blocks for any router.
    return float(min(value, limit_s))
