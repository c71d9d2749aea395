"""Content keys of KV blocks: a chained hash, so equal token prefixes give equal keys.

The key of block `i` is `blake2b(key of block i-1 || token ids of block i)`, with token ids encoded
as little-endian int64 and a fixed personalisation string. It depends only on those bytes, never on
the process, the platform or Python's hash seed, so workers on different hosts agree on keys.

With several KV-cache groups a block of tokens is one page per group: `group_keys` derives the keys
each group's pages go under. With tensor parallelism a block is several shards, one per rank:
`shard_keys` derives the keys one rank's pages go under in a tier the ranks share, from the (group)
keys and the rank's `shard_id`.
"""

from __future__ import annotations

import hashlib
from typing import Hashable, Mapping, Sequence

import numpy as np

from kvconnect.errors import KVConnectError
from kvconnect.shards import PageShards, owned

KEY_BYTES = 16
# Changing either constant changes every key: bump the version when the encoding changes.
_PERSON = b"kvconnect-blk1"
_ROOT_TAG = b"kvconnect-root1"
_SHARD_PERSON = b"kvconnect-shrd1"
_GROUP_PERSON = b"kvconnect-grp1"

Key = Hashable


def root_key(salt: bytes = b"") -> bytes:
    """The parent of a sequence's first block; `salt` separates caches that must not share blocks (model, LoRA)."""
    if not isinstance(salt, (bytes, bytearray)):
        raise KVConnectError(f"salt must be bytes, got {type(salt).__name__}")
    return hashlib.blake2b(_ROOT_TAG + bytes(salt), digest_size=KEY_BYTES, person=_PERSON).digest()


def _token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise KVConnectError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise KVConnectError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise KVConnectError("token ids do not fit in int64")
    return arr.astype("<i8", copy=False)


def block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: bytes | None = None,
    salt: bytes = b"",
) -> list[bytes]:
    """Chained keys of the full blocks of `token_ids`; a trailing partial block gets no key."""
    if block_size <= 0:
        raise KVConnectError(f"block_size must be positive, got {block_size}")
    tokens = _token_array(token_ids)
    full = tokens.size // block_size
    rows = tokens[: full * block_size].reshape(full, block_size)
    key = root_key(salt) if parent is None else bytes(parent)
    keys: list[bytes] = []
    # Inherently sequential (each key needs the previous one); one small hash per block.
    for row in rows:
        key = hashlib.blake2b(key + row.tobytes(), digest_size=KEY_BYTES, person=_PERSON).digest()
        keys.append(key)
    return keys


def check_keys(keys: Sequence[Key]) -> list[Key]:
    """Keys as a list, refusing anything that cannot be a dictionary key or is None."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise KVConnectError("keys must be a sequence of keys, not a single str or bytes")
    out = list(keys)
    for pos, key in enumerate(out):
        if key is None or not isinstance(key, Hashable):
            raise KVConnectError(f"key at position {pos} is not a usable key: {key!r}")
        try:
            hash(key)
        except TypeError as exc:
            raise KVConnectError(f"key at position {pos} is not hashable: {key!r}") from exc
    return out


def shard_id(tp: int, rank: int, pages: Mapping[str, PageShards | None]) -> bytes:
    """What makes one tensor-parallel rank's pages distinct: b"" at TP 1 (keys stay as they are), else a
    digest of the TP size, the rank and, per layer, the page split and the parts this rank holds."""
    if tp == 1:
        return b""
    lines = [f"tp{tp}:rank{rank}"]
    for name in sorted(pages):
        split = pages[name]
        if split is None:  # a page every rank holds its own way (a state layer): the rank alone tells them apart
            lines.append(f"{name}=whole")
            continue
        for s in split:
            first, n = owned(s.total, tp, rank)
            lines.append(f"{name}={s.offset},{s.repeat},{s.stride},{s.unit},{s.total}:{first}+{n}")
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=KEY_BYTES, person=_SHARD_PERSON).digest()


def shard_keys(keys: Sequence[bytes], shard: bytes) -> list[bytes]:
    """The keys one shard's pages go under in a shared tier: `keys` themselves for b"" (TP 1)."""
    if not shard:
        return list(keys)
    # One small hash per block, as block_keys: a shard's page never answers to another shard's key.
    return [hashlib.blake2b(shard + bytes(k), digest_size=KEY_BYTES, person=_SHARD_PERSON).digest() for k in keys]


def group_keys(keys: Sequence[bytes], groups: int) -> list[list[bytes]]:
    """Per KV-cache group, the keys its pages of these token blocks go under (group 0: `keys` themselves)."""
    out = [list(keys)]
    for g in range(1, groups):
        tag = g.to_bytes(2, "little")
        # One small hash per block, as block_keys: one group's page never answers to another's key.
        out.append([hashlib.blake2b(tag + bytes(k), digest_size=KEY_BYTES, person=_GROUP_PERSON).digest()
                    for k in keys])
    return out
