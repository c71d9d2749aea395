"""The wire schema: every message that crosses a kvconnect process boundary, as msgspec structs.

Nothing here is dynamic. Each message is a frozen struct that rejects unknown fields; each codec in
the table decodes exactly one type (or one tagged union) and checks the byte size of its input
against that message's limit before msgspec looks at a single byte. Failures surface as `WireError`.

`limits` holds the protocol version, the byte limits and the bounded field types; `metadata` what a
worker tells its peers (regions, groups, the compatibility fingerprint); `params` the transfer
parameters; `messages` the side channel's requests, replies and envelopes; `codec` the codecs.
Every public name is here too: `from kvconnect import wire; wire.TransferParams`.
"""

from kvconnect.wire.codec import (
    METADATA, REPLY, REPLY_ENVELOPE, REQUEST, REQUEST_ENVELOPE, TRANSFER_PARAMS, Buffer, Codec, checked_params,
    metadata_reply, probe_protocol_version,
)
from kvconnect.wire.limits import (
    MAX_BLOCKS_PER_GROUP, MAX_IDS_PER_MESSAGE, MAX_KV_GROUPS, MAX_METADATA_BYTES, MAX_NAMES_PER_REGION, MAX_REGIONS,
    MAX_REPLY_BODY_BYTES, MAX_REPLY_BYTES, MAX_REQUEST_BODY_BYTES, MAX_REQUEST_BYTES, MAX_SEGMENTS, MAX_TP,
    MAX_TRANSFER_PARAMS_BYTES, MAX_TRANSPORT_METADATA_BYTES, PROTOCOL_VERSION, KiB, MemoryKindName, MiB, WireError,
)
from kvconnect.wire.messages import (
    REPLY_TYPE, Abort, Ack, Claim, ClaimReply, ControlMessage, Done, HandshakeRejection, HandshakeReply,
    HandshakeRequest, Heartbeat, Offer, RejectionReason, ReplyBody, ReplyEnvelope, RequestBody, RequestEnvelope,
)
from kvconnect.wire.metadata import (
    Compat, EngineMetadata, GroupCompat, GroupSplitMeta, RegionMeta, SegmentMeta, process_incarnation,
)
from kvconnect.wire.params import (
    LOAD_TIMEOUT_KEY, RankAddr, TransferParams, load_timeout_from_builtins, transfer_params_from_builtins,
    transfer_params_to_builtins,
)

__all__ = [
    "LOAD_TIMEOUT_KEY", "MAX_BLOCKS_PER_GROUP", "MAX_IDS_PER_MESSAGE", "MAX_KV_GROUPS", "MAX_METADATA_BYTES",
    "MAX_NAMES_PER_REGION", "MAX_REGIONS", "MAX_REPLY_BODY_BYTES", "MAX_REPLY_BYTES", "MAX_REQUEST_BODY_BYTES",
    "MAX_REQUEST_BYTES", "MAX_SEGMENTS", "MAX_TP", "MAX_TRANSFER_PARAMS_BYTES", "MAX_TRANSPORT_METADATA_BYTES",
    "METADATA", "PROTOCOL_VERSION", "REPLY", "REPLY_ENVELOPE", "REPLY_TYPE", "REQUEST", "REQUEST_ENVELOPE",
    "TRANSFER_PARAMS", "Abort", "Ack", "Buffer", "Claim", "ClaimReply", "Codec", "Compat", "ControlMessage", "Done",
    "EngineMetadata", "GroupCompat", "GroupSplitMeta", "HandshakeRejection", "HandshakeReply", "HandshakeRequest",
    "Heartbeat", "KiB", "MemoryKindName", "MiB", "Offer", "RankAddr", "RegionMeta", "RejectionReason", "ReplyBody",
    "ReplyEnvelope", "RequestBody", "RequestEnvelope", "SegmentMeta", "TransferParams", "WireError", "checked_params",
    "load_timeout_from_builtins", "metadata_reply", "probe_protocol_version", "process_incarnation",
    "transfer_params_from_builtins", "transfer_params_to_builtins",
]
