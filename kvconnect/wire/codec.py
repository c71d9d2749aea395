"""Codecs: one per message (or tagged union), each with its byte limit, and the helpers that go
through them. Each checks the byte size of its input before msgspec looks at a single byte."""

from __future__ import annotations

from typing import Any, Union

import msgspec
from msgspec import Struct

from kvconnect.wire.limits import (
    DECODE_ERRORS, MAX_METADATA_BYTES, MAX_REPLY_BODY_BYTES, MAX_REPLY_BYTES, MAX_REQUEST_BODY_BYTES,
    MAX_REQUEST_BYTES, MAX_TRANSFER_PARAMS_BYTES, Version, WireError,
)
from kvconnect.wire.messages import HandshakeReply, ReplyBody, ReplyEnvelope, RequestBody, RequestEnvelope
from kvconnect.wire.metadata import EngineMetadata
from kvconnect.wire.params import TransferParams, transfer_params_from_builtins

Buffer = Union[bytes, bytearray, memoryview]
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
        except DECODE_ERRORS as exc:
            raise WireError(f"malformed {self.what}: {exc}") from None


class _VersionProbe(Struct):
    # Deliberately lenient (unknown fields ignored): reads the version out of a message whose schema we
    # do not speak, so that a version skew is reported as such instead of as garbage.
    protocol_version: Version


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
