"""The wire schema: every message that crosses a kvconnect process boundary, as msgspec structs.

Nothing here is dynamic. Each message is a struct that rejects unknown fields, each decoder is built
once at import time for exactly one type, and each decode checks the byte size of its input against
that message's limit before msgspec looks at a single byte. Decoding failures surface as `WireError`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
import uuid
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Literal, Sequence, Union

import msgspec
from msgspec import Meta, Struct

from kvconnect.errors import HandshakeError, KVConnectError, LayoutError

if TYPE_CHECKING:
    from kvconnect.regions import RegionSet

# Protocol history (bump on any change a peer could misread; peers only talk at equal versions):
#   1 - first wire format: MAC'd request envelope, two-phase reply (compatibility fingerprint, then
#       engine metadata as an inner payload), transfer parameters, claim/done/abort/heartbeat control
#       messages with claim-reply/ack answers.
PROTOCOL_VERSION = 1

KiB = 1 << 10
MiB = 1 << 20

# Size limits, checked on the raw bytes before decoding. A request is a rank or a few hundred request
# ids, plus a MAC; a reply is dominated by transport metadata (a transport agent's blob) and regions.
MAX_REQUEST_BYTES = 64 * KiB
MAX_REQUEST_BODY_BYTES = MAX_REQUEST_BYTES - 1 * KiB
MAX_REPLY_BYTES = 16 * MiB
MAX_METADATA_BYTES = MAX_REPLY_BYTES - 64 * KiB
MAX_TRANSPORT_METADATA_BYTES = 8 * MiB
MAX_TRANSFER_PARAMS_BYTES = 4 * MiB
MAX_NOTIFICATION_BYTES = 64 * KiB

MAX_REGIONS = 16384
MAX_NAMES_PER_REGION = 4096
MAX_KV_GROUPS = 64
MAX_BLOCKS_PER_GROUP = 1 << 20
# Request ids in one control message or notification (claim, done, abort, heartbeat); send more in chunks.
MAX_HEARTBEAT_IDS = 256

NONCE_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size

_I64_MAX = (1 << 63) - 1

_Version = Annotated[int, Meta(ge=0, le=0xFFFF_FFFF)]
_Name = Annotated[str, Meta(min_length=1, max_length=256)]
_EngineId = Annotated[str, Meta(min_length=1, max_length=256)]
_RequestId = Annotated[str, Meta(min_length=1, max_length=128)]
_Incarnation = Annotated[str, Meta(min_length=1, max_length=64)]
_Token = Annotated[str, Meta(min_length=1, max_length=64)]
_Fingerprint = Annotated[str, Meta(max_length=128)]
_Rank = Annotated[int, Meta(ge=0, le=65535)]
_WorldSize = Annotated[int, Meta(ge=1, le=65536)]
_BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
# Addresses stay below 2**63: real virtual addresses are 48 or 57 bits, and the region math is int64.
_Address = Annotated[int, Meta(ge=0, le=_I64_MAX)]
_Positive = Annotated[int, Meta(ge=1, le=_I64_MAX)]
_NonNegative = Annotated[int, Meta(ge=0, le=_I64_MAX)]
_BlockId = Annotated[int, Meta(ge=0, le=_I64_MAX)]
_Port = Annotated[int, Meta(ge=1, le=65535)]
_Host = Annotated[str, Meta(min_length=1, max_length=255)]
_Detail = Annotated[str, Meta(max_length=1024)]
# Unix seconds, bounded so that NaN and infinities never reach a comparison.
_UnixTime = Annotated[float, Meta(ge=0.0, le=1e11)]

MemoryKindName = Literal["DRAM", "VRAM"]


class WireError(KVConnectError, ValueError):
    """A message failed its size, schema or value checks."""


class IncompatiblePeerError(HandshakeError):
    """The peer's compatibility fingerprint differs from ours; `.differences` is (field, ours, theirs)."""

    def __init__(self, message: str, differences: tuple[tuple[str, object, object], ...]) -> None:
        super().__init__(message)
        self.differences = differences


_Config: Any = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)


# --------------------------------------------------------------------------------------------------
# Engine metadata


class RegionMeta(Struct, **_Config):
    """One registered memory region as it crosses the wire (mirrors `kvconnect.regions.Region`)."""

    names: Annotated[tuple[_Name, ...], Meta(min_length=1, max_length=MAX_NAMES_PER_REGION)]
    base_addr: _Address
    num_blocks: _Positive
    block_bytes: _Positive
    block_stride: _NonNegative
    device_id: Annotated[int, Meta(ge=0, le=65535)]
    memory_kind: MemoryKindName

    def __post_init__(self) -> None:
        # Cross-field checks; during decoding msgspec turns this ValueError into a ValidationError.
        if self.num_blocks > 1 and self.block_stride < self.block_bytes:
            raise ValueError(f"block_stride {self.block_stride} < block_bytes {self.block_bytes}")
        span = (self.num_blocks - 1) * self.block_stride + self.block_bytes
        if self.base_addr + span - 1 > _I64_MAX:
            raise ValueError("region extends past the 63-bit address range")


class Compat(Struct, **_Config):
    """The compatibility fingerprint: fields that must be equal for two engines to exchange KV blocks."""

    protocol_version: _Version = PROTOCOL_VERSION
    transport: _Token
    layout: _Token
    dtype: _Token
    block_size: _BlockSize
    layout_fingerprint: _Fingerprint = ""


class EngineMetadata(Struct, **_Config):
    """What a worker tells its peers about itself: identity, transport metadata and KV-cache regions."""

    protocol_version: _Version = PROTOCOL_VERSION
    engine_id: _EngineId
    # Fresh per process: a peer that restarts under the same engine id must be re-added by the transport.
    incarnation: _Incarnation
    rank: _Rank
    world_size: _WorldSize
    transport: _Token
    transport_metadata: Annotated[bytes, Meta(max_length=MAX_TRANSPORT_METADATA_BYTES)] = b""
    regions: Annotated[tuple[RegionMeta, ...], Meta(max_length=MAX_REGIONS)] = ()
    block_size: _BlockSize
    layout: _Token
    dtype: _Token
    layout_fingerprint: _Fingerprint = ""

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")

    def compat(self) -> Compat:
        """The compatibility fingerprint these metadata imply."""
        return Compat(
            protocol_version=self.protocol_version,
            transport=self.transport,
            layout=self.layout,
            dtype=self.dtype,
            block_size=self.block_size,
            layout_fingerprint=self.layout_fingerprint,
        )


# --------------------------------------------------------------------------------------------------
# Transfer parameters


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
    # Unix seconds after which the producer may free the blocks.
    lease_expiry: _UnixTime
    incarnation: _Incarnation


# --------------------------------------------------------------------------------------------------
# Side-channel requests: a metadata request, or a control message about requests' leases

# Every tagged struct names its kind in the same field, so that any of them can share a union.
_Tagged: Any = dict(tag_field="kind", **_Config)

_RequestIds = Annotated[tuple[_RequestId, ...], Meta(max_length=MAX_HEARTBEAT_IDS)]


class HandshakeRequest(Struct, tag="metadata", **_Tagged):
    """Asks a listener for the metadata of one of its ranks."""

    rank: _Rank


class _Notice(Struct, **_Tagged):
    # Who sends it: lets a producer tell the ranks of a consumer apart.
    engine_id: _EngineId
    rank: _Rank


class Claim(_Notice, tag="claim"):
    """The consumer is about to read these requests' blocks: keep them for at least `need_s` seconds.

    `incarnation` is the producer incarnation the consumer handshook with: a producer that restarted
    since refuses the whole claim, because the consumer's view of its memory is stale.
    """

    request_ids: _RequestIds
    need_s: Annotated[float, Meta(ge=0.0, le=86400.0)]
    incarnation: _Incarnation


class Done(_Notice, tag="done"):
    """The consumer finished reading these requests' blocks; the producer may free them."""

    request_ids: _RequestIds


class Abort(_Notice, tag="abort"):
    """The consumer gives up on these requests; the producer may free their blocks."""

    request_ids: _RequestIds
    reason: _Detail = ""


class Heartbeat(_Notice, tag="heartbeat"):
    """The consumer still intends to read these requests; the producer extends their leases."""

    request_ids: _RequestIds


Notification = Union[Done, Abort, Heartbeat]
ControlMessage = Union[Claim, Done, Abort, Heartbeat]
RequestBody = Union[HandshakeRequest, Claim, Done, Abort, Heartbeat]


class RequestEnvelope(Struct, **_Config):
    """A request as sent: the encoded body plus, when a secret is configured, nonce, timestamp and MAC."""

    protocol_version: _Version
    body: Annotated[bytes, Meta(max_length=MAX_REQUEST_BODY_BYTES)]
    nonce: Annotated[bytes, Meta(max_length=64)] = b""
    timestamp: _UnixTime = 0.0
    mac: Annotated[bytes, Meta(max_length=64)] = b""


# --------------------------------------------------------------------------------------------------
# Side-channel replies


class HandshakeReply(Struct, tag="reply", **_Tagged):
    """A successful metadata answer: the compatibility fingerprint first, the metadata as an inner payload."""

    compat: Compat
    payload: Annotated[bytes, Meta(max_length=MAX_METADATA_BYTES)]


class ClaimReply(Struct, tag="claim_reply", **_Tagged):
    """Per request: granted (with the unix time its lease now ends) or refused (with why)."""

    granted: Annotated[dict[_RequestId, _UnixTime], Meta(max_length=MAX_HEARTBEAT_IDS)]
    refused: Annotated[dict[_RequestId, _Detail], Meta(max_length=MAX_HEARTBEAT_IDS)] = {}
    # The producer's own incarnation, so a consumer can tell a restart from a refusal.
    incarnation: _Incarnation


class Ack(Struct, tag="ack", **_Tagged):
    """The answer to done, abort and heartbeat: which of the named requests the producer still held."""

    live: _RequestIds = ()


RejectionReason = Literal[
    "unauthenticated", "stale", "replay", "busy", "version", "unknown_rank", "unsupported", "internal"
]


class HandshakeRejection(Struct, tag="rejection", **_Tagged):
    """A refusal; the only thing a listener sends to a request it will not serve."""

    reason: RejectionReason
    detail: _Detail = ""


ControlReply = Union[ClaimReply, Ack]
ReplyBody = Union[HandshakeReply, ClaimReply, Ack, HandshakeRejection]


class ReplyEnvelope(Struct, **_Config):
    """A reply as sent: the encoded body and, for authenticated requests, a MAC bound to the request nonce."""

    protocol_version: _Version
    body: Annotated[bytes, Meta(max_length=MAX_REPLY_BYTES)]
    mac: Annotated[bytes, Meta(max_length=64)] = b""


class _VersionProbe(Struct):
    # Deliberately lenient (unknown fields ignored): reads the version out of a message whose schema we
    # do not speak, so that a version skew is reported as such instead of as garbage.
    protocol_version: _Version


# --------------------------------------------------------------------------------------------------
# Encoding and decoding

_encoder = msgspec.msgpack.Encoder()

Buffer = Union[bytes, bytearray, memoryview]

_request_envelope_decoder = msgspec.msgpack.Decoder(RequestEnvelope)
_request_decoder = msgspec.msgpack.Decoder(RequestBody)
_reply_envelope_decoder = msgspec.msgpack.Decoder(ReplyEnvelope)
_reply_body_decoder = msgspec.msgpack.Decoder(ReplyBody)
_metadata_decoder = msgspec.msgpack.Decoder(EngineMetadata)
_transfer_params_decoder = msgspec.msgpack.Decoder(TransferParams)
_notification_decoder = msgspec.msgpack.Decoder(Notification)
_version_probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)


def _nbytes(data: Buffer) -> int:
    return memoryview(data).nbytes


def _encode(msg: Struct, limit: int, what: str) -> bytes:
    data = _encoder.encode(msg)
    if len(data) > limit:
        raise WireError(f"{what} encodes to {len(data)} bytes, over its {limit}-byte limit")
    return data


def _decode(decoder: msgspec.msgpack.Decoder, data: Buffer, limit: int, what: str) -> Any:
    size = _nbytes(data)
    if size > limit:
        raise WireError(f"{what} is {size} bytes, over its {limit}-byte limit")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise WireError(f"malformed {what}: {exc}") from None


def encode_request_envelope(env: RequestEnvelope) -> bytes:
    """Encode a handshake request envelope."""
    return _encode(env, MAX_REQUEST_BYTES, "side-channel request")


def decode_request_envelope(data: Buffer) -> RequestEnvelope:
    """Decode a handshake request envelope; raises WireError."""
    return _decode(_request_envelope_decoder, data, MAX_REQUEST_BYTES, "side-channel request")


def encode_request(req: HandshakeRequest | Claim | Done | Abort | Heartbeat) -> bytes:
    """Encode the body of a side-channel request (a metadata request or a control message)."""
    return _encode(req, MAX_REQUEST_BODY_BYTES, "request body")


def decode_request(data: Buffer) -> HandshakeRequest | Claim | Done | Abort | Heartbeat:
    """Decode the body of a side-channel request; raises WireError."""
    return _decode(_request_decoder, data, MAX_REQUEST_BODY_BYTES, "request body")


def encode_reply_envelope(env: ReplyEnvelope) -> bytes:
    """Encode a handshake reply envelope."""
    return _encode(env, MAX_REPLY_BYTES, "side-channel reply")


def decode_reply_envelope(data: Buffer) -> ReplyEnvelope:
    """Decode a handshake reply envelope; raises WireError."""
    return _decode(_reply_envelope_decoder, data, MAX_REPLY_BYTES, "side-channel reply")


def encode_reply_body(body: HandshakeReply | ClaimReply | Ack | HandshakeRejection) -> bytes:
    """Encode a reply body (metadata, a control answer, or a rejection)."""
    return _encode(body, MAX_REPLY_BYTES - 1 * KiB, "reply body")


def decode_reply_body(data: Buffer) -> HandshakeReply | ClaimReply | Ack | HandshakeRejection:
    """Decode a reply body into one of the ReplyBody structs; raises WireError."""
    return _decode(_reply_body_decoder, data, MAX_REPLY_BYTES - 1 * KiB, "reply body")


def encode_metadata(meta: EngineMetadata) -> bytes:
    """Encode engine metadata (the inner payload of a reply)."""
    return _encode(meta, MAX_METADATA_BYTES, "engine metadata")


def decode_metadata(data: Buffer) -> EngineMetadata:
    """Decode engine metadata; raises WireError."""
    return _decode(_metadata_decoder, data, MAX_METADATA_BYTES, "engine metadata")


def encode_transfer_params(params: TransferParams) -> bytes:
    """Encode transfer parameters as msgpack."""
    return _encode(params, MAX_TRANSFER_PARAMS_BYTES, "transfer parameters")


def decode_transfer_params(data: Buffer) -> TransferParams:
    """Decode msgpack transfer parameters; raises WireError."""
    return _decode(_transfer_params_decoder, data, MAX_TRANSFER_PARAMS_BYTES, "transfer parameters")


def transfer_params_to_builtins(params: TransferParams) -> dict[str, Any]:
    """Transfer parameters as a plain dict, for frontends that carry them inside JSON."""
    return msgspec.to_builtins(params)


def transfer_params_from_builtins(obj: object) -> TransferParams:
    """Validate transfer parameters that arrived as plain objects (e.g. parsed JSON); raises WireError."""
    try:
        return msgspec.convert(obj, TransferParams, strict=True)
    except (msgspec.ValidationError, RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise WireError(f"malformed transfer parameters: {exc}") from None


def encode_notification(note: Done | Abort | Heartbeat) -> bytes:
    """Encode a notification (done, abort or heartbeat)."""
    return _encode(note, MAX_NOTIFICATION_BYTES, "notification")


def decode_notification(data: Buffer) -> Done | Abort | Heartbeat:
    """Decode a notification into Done, Abort or Heartbeat; raises WireError."""
    return _decode(_notification_decoder, data, MAX_NOTIFICATION_BYTES, "notification")


def probe_protocol_version(data: Buffer, limit: int = MAX_REPLY_BYTES) -> int | None:
    """The `protocol_version` of a message we could not decode, or None if it has none."""
    try:
        return _decode(_version_probe_decoder, data, limit, "message").protocol_version
    except WireError:
        return None


# --------------------------------------------------------------------------------------------------
# Authentication

_REQUEST_MAC_DOMAIN = b"kvconnect handshake request\x00"
_REPLY_MAC_DOMAIN = b"kvconnect handshake reply\x00"


def new_nonce() -> bytes:
    """A fresh random request nonce."""
    return os.urandom(NONCE_BYTES)


def request_mac(secret: bytes, protocol_version: int, nonce: bytes, timestamp: float, body: bytes) -> bytes:
    """HMAC-SHA256 of a request over protocol version, nonce, timestamp and body."""
    # Lengths are framed explicitly so that no two (nonce, body) splits share a MAC input.
    head = struct.pack(">IHd", protocol_version, len(nonce), timestamp)
    return hmac.new(secret, _REQUEST_MAC_DOMAIN + head + nonce + body, hashlib.sha256).digest()


def reply_mac(secret: bytes, protocol_version: int, request_nonce: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of a reply body, bound to the nonce of the request it answers."""
    head = struct.pack(">IH", protocol_version, len(request_nonce))
    return hmac.new(secret, _REPLY_MAC_DOMAIN + head + request_nonce + body, hashlib.sha256).digest()


# --------------------------------------------------------------------------------------------------
# Compatibility


def check_compat(expected: Compat, got: Compat) -> None:
    """Raise IncompatiblePeerError (a HandshakeError) naming every field where `got` differs."""
    differences = tuple(
        (name, getattr(expected, name), getattr(got, name))
        for name in Compat.__struct_fields__
        if getattr(expected, name) != getattr(got, name)
    )
    if differences:
        listed = "; ".join(f"{name}: ours {ours!r}, peer's {theirs!r}" for name, ours, theirs in differences)
        fields = ", ".join(name for name, _, _ in differences)
        raise IncompatiblePeerError(f"incompatible peer ({fields} differ): {listed}", differences)


# --------------------------------------------------------------------------------------------------
# Identity and regions

_incarnation: tuple[int, str] | None = None


def process_incarnation() -> str:
    """This process's incarnation id: random, fixed for the process's life, fresh in a forked child."""
    global _incarnation
    pid = os.getpid()
    if _incarnation is None or _incarnation[0] != pid:
        _incarnation = (pid, uuid.uuid4().hex)
    return _incarnation[1]


def regions_to_wire(region_set: RegionSet) -> tuple[RegionMeta, ...]:
    """The wire form of a RegionSet."""
    return tuple(
        RegionMeta(
            names=tuple(str(n) for n in r.names),
            base_addr=int(r.base_addr),
            num_blocks=int(r.num_blocks),
            block_bytes=int(r.block_bytes),
            block_stride=int(r.block_stride),
            device_id=int(r.device_id),
            memory_kind=r.memory_kind.value if isinstance(r.memory_kind, Enum) else str(r.memory_kind),
        )
        for r in region_set.regions
    )


def regions_from_wire(regions: Sequence[RegionMeta]) -> RegionSet:
    """Rebuild a RegionSet from decoded wire regions; raises WireError if they do not make sense."""
    # Imported here: the handshake path must not pay for torch/numpy, which kvconnect.regions pulls in.
    from kvconnect.regions import MemoryKind, Region, RegionSet

    try:
        return RegionSet(
            [
                Region(
                    names=tuple(r.names),
                    base_addr=r.base_addr,
                    num_blocks=r.num_blocks,
                    block_bytes=r.block_bytes,
                    block_stride=r.block_stride,
                    device_id=r.device_id,
                    memory_kind=MemoryKind(r.memory_kind),
                )
                for r in regions
            ]
        )
    except (LayoutError, ValueError, OverflowError) as exc:
        raise WireError(f"peer regions are invalid: {exc}") from None


__all__ = [
    "MAC_BYTES",
    "MAX_HEARTBEAT_IDS",
    "MAX_METADATA_BYTES",
    "MAX_NOTIFICATION_BYTES",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_TRANSFER_PARAMS_BYTES",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "Abort",
    "Ack",
    "Claim",
    "ClaimReply",
    "Compat",
    "ControlMessage",
    "ControlReply",
    "Done",
    "EngineMetadata",
    "HandshakeRejection",
    "HandshakeReply",
    "HandshakeRequest",
    "Heartbeat",
    "IncompatiblePeerError",
    "Notification",
    "RegionMeta",
    "ReplyBody",
    "ReplyEnvelope",
    "RequestBody",
    "RequestEnvelope",
    "TransferParams",
    "WireError",
    "check_compat",
    "decode_metadata",
    "decode_notification",
    "decode_reply_body",
    "decode_reply_envelope",
    "decode_request",
    "decode_request_envelope",
    "decode_transfer_params",
    "encode_metadata",
    "encode_notification",
    "encode_reply_body",
    "encode_reply_envelope",
    "encode_request",
    "encode_request_envelope",
    "encode_transfer_params",
    "new_nonce",
    "probe_protocol_version",
    "process_incarnation",
    "regions_from_wire",
    "regions_to_wire",
    "reply_mac",
    "request_mac",
    "transfer_params_from_builtins",
    "transfer_params_to_builtins",
]
