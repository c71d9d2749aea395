"""The wire schema: every message that crosses a kvconnect process boundary, as msgspec structs.

Nothing here is dynamic. Each message is a frozen struct that rejects unknown fields; each codec in
the table below decodes exactly one type (or one tagged union) and checks the byte size of its input
against that message's limit before msgspec looks at a single byte. Failures surface as `WireError`.
"""

from __future__ import annotations

import os
import uuid
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

from kvconnect.errors import KVConnectError

# Protocol history (bump on any change a peer could misread; peers only talk at equal versions):
#   1 - MAC'd request envelope, two-phase reply, transfer parameters, claim/done/abort/heartbeat.
#   2 - KV-cache groups in the metadata and the compatibility check (labels, page bytes, layer map);
#       claims granted for a duration rather than until a wall-clock time.
#   3 - tensor parallelism: regions describe their split across ranks, transfer params name every
#       rank of the producer, notices say how many consumer ranks read a lease; page bytes in the
#       compatibility check are those of TP 1.
#   4 - push mode: a decode instance offers its blocks to a prefill instance (`Offer`).
PROTOCOL_VERSION = 4

KiB = 1 << 10
MiB = 1 << 20

# Size limits, checked on the raw bytes before decoding. A request is a rank or a few hundred request
# ids, plus a MAC; a reply is dominated by transport metadata (a transport agent's blob) and regions.
MAX_REQUEST_BYTES = 64 * KiB
MAX_REQUEST_BODY_BYTES = MAX_REQUEST_BYTES - 1 * KiB
MAX_REPLY_BYTES = 16 * MiB
MAX_REPLY_BODY_BYTES = MAX_REPLY_BYTES - 1 * KiB
MAX_METADATA_BYTES = MAX_REPLY_BYTES - 64 * KiB
MAX_TRANSPORT_METADATA_BYTES = 8 * MiB
MAX_TRANSFER_PARAMS_BYTES = 4 * MiB

MAX_REGIONS = 16384
MAX_NAMES_PER_REGION = 4096
MAX_KV_GROUPS = 64
MAX_BLOCKS_PER_GROUP = 1 << 20
# Request ids in one control message (claim, done, abort, heartbeat); send more in chunks.
MAX_IDS_PER_MESSAGE = 256
MAX_SEGMENTS = 64
MAX_TP = 1024

_I64_MAX = (1 << 63) - 1

_Version = Annotated[int, Meta(ge=0, le=0xFFFF_FFFF)]
_Name = Annotated[str, Meta(min_length=1, max_length=256)]
_EngineId = Annotated[str, Meta(min_length=1, max_length=256)]
_RequestId = Annotated[str, Meta(min_length=1, max_length=128)]
_Incarnation = Annotated[str, Meta(min_length=1, max_length=64)]
_Token = Annotated[str, Meta(min_length=1, max_length=64)]
_Rank = Annotated[int, Meta(ge=0, le=65535)]
_BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
# Addresses stay below 2**63: real virtual addresses are 48 or 57 bits, and the region math is int64.
_Address = Annotated[int, Meta(ge=0, le=_I64_MAX)]
_Positive = Annotated[int, Meta(ge=1, le=_I64_MAX)]
_NonNegative = Annotated[int, Meta(ge=0, le=_I64_MAX)]
_BlockId = Annotated[int, Meta(ge=0, le=_I64_MAX)]
_RegionIndex = Annotated[int, Meta(ge=0, lt=MAX_REGIONS)]
_Port = Annotated[int, Meta(ge=1, le=65535)]
_Host = Annotated[str, Meta(min_length=1, max_length=255)]
_Detail = Annotated[str, Meta(max_length=1024)]
_Digest = Annotated[str, Meta(max_length=64)]
# Unix seconds and durations, bounded so that NaN and infinities never reach a comparison.
_UnixTime = Annotated[float, Meta(ge=0.0, le=1e11)]
_Seconds = Annotated[float, Meta(ge=0.0, le=86400.0)]

MemoryKindName = Literal["DRAM", "VRAM"]


class WireError(KVConnectError, ValueError):
    """A message failed its size, schema or value checks."""


_Config: Any = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)
# Every tagged struct names its kind in the same field, so that any of them can share a union.
_Tagged: Any = dict(tag_field="kind", **_Config)


# ---- engine metadata ----

class SegmentMeta(Struct, array_like=True, **_Config):
    """One segment of a page's split across TP ranks (mirrors `kvconnect.shards.Segment`)."""

    offset: _NonNegative
    repeat: Annotated[int, Meta(ge=1, le=1 << 16)]
    stride: _NonNegative
    unit: _Positive
    total: Annotated[int, Meta(ge=1, le=1 << 20)]


class RegionMeta(Struct, **_Config):
    """One registered memory region as it crosses the wire (mirrors `kvconnect.regions.Region`)."""

    names: Annotated[tuple[_Name, ...], Meta(min_length=1, max_length=MAX_NAMES_PER_REGION)]
    base_addr: _Address
    num_blocks: _Positive
    block_bytes: _Positive
    block_stride: _NonNegative
    device_id: Annotated[int, Meta(ge=0, le=65535)]
    memory_kind: MemoryKindName
    # How a page splits across TP ranks; None when the engine described no split (TP sizes must match).
    shards: Annotated[tuple[SegmentMeta, ...], Meta(min_length=1, max_length=MAX_SEGMENTS)] | None = None

    def __post_init__(self) -> None:
        # Cross-field checks; during decoding msgspec turns this ValueError into a ValidationError.
        if self.num_blocks > 1 and self.block_stride < self.block_bytes:
            raise ValueError(f"block_stride {self.block_stride} < block_bytes {self.block_bytes}")
        span = (self.num_blocks - 1) * self.block_stride + self.block_bytes
        if self.base_addr + span - 1 > _I64_MAX:
            raise ValueError("region extends past the 63-bit address range")


class GroupCompat(Struct, **_Config):
    """What two engines must agree on about one KV-cache group.

    `label` is the engine's name for the group's kind, compared, never interpreted; `page_bytes` are
    the bytes of one block of each of the group's layers, as registered; `layers` hashes their names.
    """

    label: _Token
    block_size: _BlockSize
    page_bytes: Annotated[tuple[_Positive, ...], Meta(min_length=1, max_length=MAX_REGIONS)]
    layers: _Digest


class Compat(Struct, **_Config):
    """The compatibility fingerprint: fields that must be equal for two engines to exchange KV blocks."""

    protocol_version: _Version = PROTOCOL_VERSION
    transport: _Token
    layout: _Token
    dtype: _Token
    block_size: _BlockSize
    groups: Annotated[tuple[GroupCompat, ...], Meta(min_length=1, max_length=MAX_KV_GROUPS)]


class EngineMetadata(Struct, **_Config):
    """What a worker tells its peers about itself: identity, transport metadata, regions and groups."""

    protocol_version: _Version = PROTOCOL_VERSION
    engine_id: _EngineId
    # Fresh per process: a peer that restarts under the same engine id must be re-added by the transport.
    incarnation: _Incarnation
    rank: _Rank
    # The engine's tensor-parallel size: each rank is one worker with its own regions and side channel.
    world_size: Annotated[int, Meta(ge=1, le=MAX_TP)]
    transport: _Token
    transport_metadata: Annotated[bytes, Meta(max_length=MAX_TRANSPORT_METADATA_BYTES)] = b""
    regions: Annotated[tuple[RegionMeta, ...], Meta(min_length=1, max_length=MAX_REGIONS)]
    # Region indices of each KV-cache group; a region shared by groups appears in each of them.
    group_regions: Annotated[tuple[Annotated[tuple[_RegionIndex, ...], Meta(min_length=1)], ...],
                             Meta(min_length=1, max_length=MAX_KV_GROUPS)]
    block_size: _BlockSize
    layout: _Token
    dtype: _Token
    compat: Compat

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if any(k >= len(self.regions) for g in self.group_regions for k in g):
            raise ValueError(f"a group names a region index past the {len(self.regions)} regions")
        if len(self.group_regions) != len(self.compat.groups):
            raise ValueError("group_regions and compat.groups differ in length")


# ---- transfer parameters ----

class RankAddr(Struct, array_like=True, **_Config):
    """Where one TP rank of a producer answers, and the incarnation its blocks were held under."""

    host: _Host
    port: _Port
    incarnation: _Incarnation


class TransferParams(Struct, **_Config):
    """What a producer hands out for one request so that a consumer can pull its KV blocks."""

    engine_id: _EngineId
    host: _Host
    port: _Port
    request_id: _RequestId
    # One list of block ids per KV-cache group.
    block_ids: Annotated[
        list[Annotated[list[_BlockId], Meta(max_length=MAX_BLOCKS_PER_GROUP)]],
        Meta(min_length=1, max_length=MAX_KV_GROUPS),
    ]
    num_tokens: _NonNegative
    # Unix seconds after which the producer may free the blocks (advice: heartbeats extend it).
    lease_expiry: _UnixTime
    incarnation: _Incarnation
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


# ---- side-channel requests: a metadata request, or a control message about requests' leases ----

_RequestIds = Annotated[tuple[_RequestId, ...], Meta(max_length=MAX_IDS_PER_MESSAGE)]


class HandshakeRequest(Struct, tag="metadata", **_Tagged):
    """Asks a listener for the metadata of one of its ranks."""

    rank: _Rank


class _Notice(Struct, **_Tagged):
    # Who sends it: lets a producer tell the ranks of a consumer apart.
    engine_id: _EngineId
    rank: _Rank


# How many consumer ranks read one lease: it ends once that many distinct ranks said done or abort.
_Readers = Annotated[int, Meta(ge=1, le=MAX_TP)]


class Claim(_Notice, tag="claim"):
    """The consumer is about to read these requests' blocks: keep them for at least `need_s` seconds.

    `incarnation` is the producer incarnation the consumer handshook with: a producer that restarted
    since refuses the whole claim, because the consumer's view of its memory is stale.
    """

    request_ids: _RequestIds
    need_s: _Seconds
    incarnation: _Incarnation
    readers: _Readers = 1


class Done(_Notice, tag="done"):
    """This consumer rank finished reading these requests' blocks; the producer frees them once all
    `readers` ranks have."""

    request_ids: _RequestIds
    readers: _Readers = 1


class Abort(_Notice, tag="abort"):
    """This consumer rank gives up on these requests; counted like done (it reads no more)."""

    request_ids: _RequestIds
    reason: _Detail = ""
    readers: _Readers = 1


class Heartbeat(_Notice, tag="heartbeat"):
    """The consumer still intends to read these requests; the producer extends their leases."""

    request_ids: _RequestIds


class Offer(_Notice, tag="offer"):
    """Push mode: a decode rank allocated blocks for the prefill of `key` and holds them under a lease
    (`params` name them, as a producer's params would); the prefill writes into them and says done."""

    key: _RequestId
    params: TransferParams


ControlMessage = Union[Claim, Done, Abort, Heartbeat, Offer]
RequestBody = Union[HandshakeRequest, Claim, Done, Abort, Heartbeat, Offer]


class RequestEnvelope(Struct, **_Config):
    """A request as sent: the encoded body plus, when a secret is configured, nonce, timestamp and MAC."""

    protocol_version: _Version
    body: Annotated[bytes, Meta(max_length=MAX_REQUEST_BODY_BYTES)]
    nonce: Annotated[bytes, Meta(max_length=64)] = b""
    timestamp: _UnixTime = 0.0
    mac: Annotated[bytes, Meta(max_length=64)] = b""


# ---- side-channel replies ----

class HandshakeReply(Struct, tag="reply", **_Tagged):
    """A metadata answer: the compatibility fingerprint first, the metadata as an inner payload."""

    compat: Compat
    payload: Annotated[bytes, Meta(max_length=MAX_METADATA_BYTES)]


class ClaimReply(Struct, tag="claim_reply", **_Tagged):
    """Per request: granted (for how many seconds from the claim's arrival) or refused (with why)."""

    granted_s: Annotated[dict[_RequestId, _Seconds], Meta(max_length=MAX_IDS_PER_MESSAGE)]
    refused: Annotated[dict[_RequestId, _Detail], Meta(max_length=MAX_IDS_PER_MESSAGE)] = {}
    # The producer's own incarnation, so a consumer can tell a restart from a refusal.
    incarnation: _Incarnation


class Ack(Struct, tag="ack", **_Tagged):
    """The answer to done, abort, heartbeat and offer: which of the named requests (keys) it holds."""

    live: _RequestIds = ()


RejectionReason = Literal[
    "unauthenticated", "stale", "replay", "busy", "version", "unknown_rank", "unsupported", "internal"
]


class HandshakeRejection(Struct, tag="rejection", **_Tagged):
    """A refusal; the only thing a listener sends to a request it will not serve."""

    reason: RejectionReason
    detail: _Detail = ""


ReplyBody = Union[HandshakeReply, ClaimReply, Ack, HandshakeRejection]

# The one answer type each request gets (a rejection aside).
REPLY_TYPE: dict[type, type] = {HandshakeRequest: HandshakeReply, Claim: ClaimReply, Done: Ack, Abort: Ack,
                                Heartbeat: Ack, Offer: Ack}


class ReplyEnvelope(Struct, **_Config):
    """A reply as sent: the encoded body and, for authenticated requests, a MAC bound to the request nonce."""

    protocol_version: _Version
    body: Annotated[bytes, Meta(max_length=MAX_REPLY_BYTES)]
    mac: Annotated[bytes, Meta(max_length=64)] = b""


class _VersionProbe(Struct):
    # Deliberately lenient (unknown fields ignored): reads the version out of a message whose schema we
    # do not speak, so that a version skew is reported as such instead of as garbage.
    protocol_version: _Version


# ---- codecs: one per message (or tagged union), each with its byte limit ----

Buffer = Union[bytes, bytearray, memoryview]
_DECODE_ERRORS = (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError)
_encoder = msgspec.msgpack.Encoder()


class Codec:
    """Encodes and decodes one message type within its byte limit; failures are WireError."""

    def __init__(self, type_: Any, limit: int, what: str) -> None:
        self.type, self.limit, self.what = type_, limit, what
        self._decoder = msgspec.msgpack.Decoder(type_)

    def encode(self, msg: Any) -> bytes:
        """The message as msgpack; WireError when it does not fit its limit or cannot be encoded."""
        try:
            data = _encoder.encode(msg)
        except (TypeError, OverflowError) as exc:
            raise WireError(f"cannot encode {self.what}: {exc}") from None
        if len(data) > self.limit:
            raise WireError(f"{self.what} encodes to {len(data)} bytes, over its {self.limit}-byte limit")
        return data

    def decode(self, data: Buffer) -> Any:
        """The message in `data`, checked against its size limit and schema."""
        size = memoryview(data).nbytes
        if size > self.limit:
            raise WireError(f"{self.what} is {size} bytes, over its {self.limit}-byte limit")
        try:
            return self._decoder.decode(data)
        except _DECODE_ERRORS as exc:
            raise WireError(f"malformed {self.what}: {exc}") from None


REQUEST_ENVELOPE = Codec(RequestEnvelope, MAX_REQUEST_BYTES, "side-channel request")
REQUEST = Codec(RequestBody, MAX_REQUEST_BODY_BYTES, "request body")
REPLY_ENVELOPE = Codec(ReplyEnvelope, MAX_REPLY_BYTES, "side-channel reply")
REPLY = Codec(ReplyBody, MAX_REPLY_BODY_BYTES, "reply body")
METADATA = Codec(EngineMetadata, MAX_METADATA_BYTES, "engine metadata")
TRANSFER_PARAMS = Codec(TransferParams, MAX_TRANSFER_PARAMS_BYTES, "transfer parameters")
_VERSION_PROBE = Codec(_VersionProbe, MAX_REPLY_BYTES, "message")


def probe_protocol_version(data: Buffer) -> int | None:
    """The `protocol_version` of a message we could not decode, or None if it has none."""
    try:
        return _VERSION_PROBE.decode(data).protocol_version
    except WireError:
        return None


def transfer_params_to_builtins(params: TransferParams) -> dict[str, Any]:
    """Transfer parameters as a plain dict, for frontends that carry them inside JSON."""
    return msgspec.to_builtins(params)


def transfer_params_from_builtins(obj: object) -> TransferParams:
    """Validate transfer parameters that arrived as plain objects (e.g. parsed JSON); raises WireError."""
    try:
        return msgspec.convert(obj, TransferParams, strict=True)
    except (msgspec.ValidationError, *_DECODE_ERRORS) as exc:
        raise WireError(f"malformed transfer parameters: {exc}") from None


def checked_params(params: object) -> TransferParams:
    """Transfer parameters checked against the schema however they were built (struct constructors
    do not check values: a struct built in Python gets the same checks as one read off the wire)."""
    if isinstance(params, TransferParams):
        return TRANSFER_PARAMS.decode(TRANSFER_PARAMS.encode(params))
    if isinstance(params, dict):
        return transfer_params_from_builtins(params)
    raise WireError(f"transfer parameters must be TransferParams or a dict, got {type(params).__name__}")


def metadata_reply(meta: EngineMetadata) -> HandshakeReply:
    """The two-phase answer to a metadata request; WireError if `meta` would not decode on the peer."""
    payload = METADATA.encode(meta)
    # Struct constructors do not type-check; decoding our own payload finds a bug here, with a log
    # line on this side, instead of as a puzzling "malformed" on every peer.
    METADATA.decode(payload)
    return HandshakeReply(compat=meta.compat, payload=payload)


# ---- identity and regions ----

_incarnation: tuple[int, str] | None = None


def process_incarnation() -> str:
    """This process's incarnation id: random, fixed for the process's life, fresh in a forked child."""
    global _incarnation
    pid = os.getpid()
    if _incarnation is None or _incarnation[0] != pid:
        _incarnation = (pid, uuid.uuid4().hex)
    return _incarnation[1]
