"""The side channel's messages: a metadata request or a control message about requests' leases, the
replies to them, and the envelopes both travel in (the encoded body, plus a MAC when authenticated)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from msgspec import Meta, Struct

from kvconnect.wire.limits import (
    MAX_IDS_PER_MESSAGE, MAX_METADATA_BYTES, MAX_REPLY_BYTES, MAX_REQUEST_BODY_BYTES, MAX_TP, STRUCT_CONFIG,
    TAGGED_CONFIG, Detail, EngineId, Incarnation, Rank, RequestId, Seconds, UnixTime, Version,
)
from kvconnect.wire.metadata import Compat
from kvconnect.wire.params import TransferParams

# ---- requests ----

_RequestIds = Annotated[tuple[RequestId, ...], Meta(max_length=MAX_IDS_PER_MESSAGE)]


class HandshakeRequest(Struct, tag="metadata", **TAGGED_CONFIG):
    """Asks a listener for the metadata of one of its ranks."""

    rank: Rank


class _Notice(Struct, **TAGGED_CONFIG):
    # Who sends it: lets a producer tell the ranks of a consumer apart.
    engine_id: EngineId
    rank: Rank


# How many consumer ranks read one lease: it ends once that many distinct ranks said done or abort.
_Readers = Annotated[int, Meta(ge=1, le=MAX_TP)]


class Claim(_Notice, tag="claim"):
    """The consumer is about to read these requests' blocks: keep them for at least `need_s` seconds.

    `incarnation` is the producer incarnation the consumer handshook with: a producer that restarted
    since refuses the whole claim, because the consumer's view of its memory is stale.
    """

    request_ids: _RequestIds
    need_s: Seconds
    incarnation: Incarnation
    readers: _Readers = 1


class Done(_Notice, tag="done"):
    """This consumer rank finished reading these requests' blocks; the producer frees them once all
    `readers` ranks have."""

    request_ids: _RequestIds
    readers: _Readers = 1


class Abort(_Notice, tag="abort"):
    """This consumer rank gives up on these requests; counted like done (it reads no more)."""

    request_ids: _RequestIds
    reason: Detail = ""
    readers: _Readers = 1


class Heartbeat(_Notice, tag="heartbeat"):
    """The consumer still intends to read these requests; the producer extends their leases."""

    request_ids: _RequestIds


class Offer(_Notice, tag="offer"):
    """Push mode: a decode rank allocated blocks for the prefill of `key` and holds them under a lease
    (`params` name them, as a producer's params would); the prefill writes into them and says done.
    A decode of `tp_size` ranks offers from every rank to every prefill rank: each prefill rank writes
    once it holds all `tp_size` offers of a key."""

    key: RequestId
    params: TransferParams
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP)] = 1


ControlMessage = Union[Claim, Done, Abort, Heartbeat, Offer]
RequestBody = Union[HandshakeRequest, Claim, Done, Abort, Heartbeat, Offer]


class RequestEnvelope(Struct, **STRUCT_CONFIG):
    """A request as sent: the encoded body plus, when a secret is configured, nonce, timestamp and MAC."""

    protocol_version: Version
    body: Annotated[bytes, Meta(max_length=MAX_REQUEST_BODY_BYTES)]
    nonce: Annotated[bytes, Meta(max_length=64)] = b""
    timestamp: UnixTime = 0.0
    mac: Annotated[bytes, Meta(max_length=64)] = b""


# ---- replies ----

class HandshakeReply(Struct, tag="reply", **TAGGED_CONFIG):
    """A metadata answer: the compatibility fingerprint first, the metadata as an inner payload."""

    compat: Compat
    payload: Annotated[bytes, Meta(max_length=MAX_METADATA_BYTES)]


class ClaimReply(Struct, tag="claim_reply", **TAGGED_CONFIG):
    """Per request: granted (for how many seconds from the claim's arrival) or refused (with why)."""

    granted_s: Annotated[dict[RequestId, Seconds], Meta(max_length=MAX_IDS_PER_MESSAGE)]
    refused: Annotated[dict[RequestId, Detail], Meta(max_length=MAX_IDS_PER_MESSAGE)] = {}
    # The producer's own incarnation, so a consumer can tell a restart from a refusal.
    incarnation: Incarnation


class Ack(Struct, tag="ack", **TAGGED_CONFIG):
    """The answer to done, abort, heartbeat and offer: which of the named requests (keys) it holds."""

    live: _RequestIds = ()


RejectionReason = Literal[
    "unauthenticated", "stale", "replay", "busy", "version", "unknown_rank", "unsupported", "internal"
]


class HandshakeRejection(Struct, tag="rejection", **TAGGED_CONFIG):
    """A refusal; the only thing a listener sends to a request it will not serve."""

    reason: RejectionReason
    detail: Detail = ""


ReplyBody = Union[HandshakeReply, ClaimReply, Ack, HandshakeRejection]

# The one answer type each request gets (a rejection aside).
REPLY_TYPE: dict[type, type] = {HandshakeRequest: HandshakeReply, Claim: ClaimReply, Done: Ack, Abort: Ack,
                                Heartbeat: Ack, Offer: Ack}


class ReplyEnvelope(Struct, **STRUCT_CONFIG):
    """A reply as sent: the encoded body and, for authenticated requests, a MAC bound to the request nonce."""

    protocol_version: Version
    body: Annotated[bytes, Meta(max_length=MAX_REPLY_BYTES)]
    mac: Annotated[bytes, Meta(max_length=64)] = b""
