"""What a message may hold: the protocol version, the byte limits, and the bounded field types.

Every limit is checked before or while msgspec decodes, so that a peer's bytes never grow a list, a
string or a number past what the receiver is prepared to hold. Failures surface as `WireError`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvconnect.errors import KVConnectError

# Protocol history (bump on any change a peer could misread; peers only talk at equal versions):
#   1 - MAC'd request envelope, two-phase reply, transfer parameters, claim/done/abort/heartbeat.
#   2 - KV-cache groups in the metadata and the compatibility check (labels, page bytes, layer map);
#       claims granted for a duration rather than until a wall-clock time.
#   3 - tensor parallelism: regions describe their split across ranks, transfer params name every
#       rank of the producer, notices say how many consumer ranks read a lease; page bytes in the
#       compatibility check are those of TP 1.
#   4 - push mode: a decode instance offers its blocks to a prefill instance (`Offer`).
#   5 - push between TP sizes: an offer says how many ranks the decode runs (`Offer.tp_size`).
#   6 - a region that KV-cache groups read with different splits carries one per group
#       (`RegionMeta.group_shards`); bytes outside every segment of a split are padding.
PROTOCOL_VERSION = 6

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

I64_MAX = (1 << 63) - 1

Version = Annotated[int, Meta(ge=0, le=0xFFFF_FFFF)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
EngineId = Annotated[str, Meta(min_length=1, max_length=256)]
RequestId = Annotated[str, Meta(min_length=1, max_length=128)]
Incarnation = Annotated[str, Meta(min_length=1, max_length=64)]
Token = Annotated[str, Meta(min_length=1, max_length=64)]
Rank = Annotated[int, Meta(ge=0, le=65535)]
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
# Addresses stay below 2**63: real virtual addresses are 48 or 57 bits, and the region math is int64.
Address = Annotated[int, Meta(ge=0, le=I64_MAX)]
Positive = Annotated[int, Meta(ge=1, le=I64_MAX)]
NonNegative = Annotated[int, Meta(ge=0, le=I64_MAX)]
BlockId = Annotated[int, Meta(ge=0, le=I64_MAX)]
RegionIndex = Annotated[int, Meta(ge=0, lt=MAX_REGIONS)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Host = Annotated[str, Meta(min_length=1, max_length=255)]
Detail = Annotated[str, Meta(max_length=1024)]
Digest = Annotated[str, Meta(max_length=64)]
# Unix seconds and durations, bounded so that NaN and infinities never reach a comparison.
UnixTime = Annotated[float, Meta(ge=0.0, le=1e11)]
Seconds = Annotated[float, Meta(ge=0.0, le=86400.0)]

MemoryKindName = Literal["DRAM", "VRAM"]

# Every struct is frozen and rejects unknown fields; every tagged struct names its kind in the same
# field, so that any of them can share a union.
STRUCT_CONFIG: Any = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)
TAGGED_CONFIG: Any = dict(tag_field="kind", **STRUCT_CONFIG)


class WireError(KVConnectError, ValueError):
    """A message failed its size, schema or value checks."""


# What msgspec (and the structs' own cross-field checks) raise on input they refuse.
DECODE_ERRORS = (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError)
