"""Chained block keys: equal prefixes give equal keys, and the encoding is stable across processes."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect import KVConnectError
from kvconnect.offload.keys import KEY_BYTES, block_keys, check_keys, root_key


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=40), st.integers(1, 6),
       st.lists(st.integers(0, 50_000), max_size=20), st.lists(st.integers(0, 50_000), max_size=20))
def test_keys_are_shared_exactly_as_far_as_whole_blocks_of_the_prefix(prefix, block_size, tail_a, tail_b) -> None:
    a, b = block_keys(prefix + tail_a, block_size), block_keys(prefix + tail_b, block_size)
    assert len(a) == len(prefix + tail_a) // block_size
    shared = len(prefix) // block_size
    assert a[:shared] == b[:shared]
    # Past the shared blocks, keys agree only where the whole token history agrees.
    seq_a, seq_b = prefix + tail_a, prefix + tail_b
    for i in range(shared, min(len(a), len(b))):
        assert (a[i] == b[i]) == (seq_a[: (i + 1) * block_size] == seq_b[: (i + 1) * block_size])
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in a)


def test_a_key_depends_on_its_parent_not_only_on_its_own_tokens() -> None:
    same_last_block = block_keys([1, 2, 9, 9], 2), block_keys([3, 4, 9, 9], 2)
    assert same_last_block[0][1] != same_last_block[1][1]
    chained = block_keys([9, 9], 2, parent=same_last_block[0][0])
    assert chained == [same_last_block[0][1]]


def test_the_encoding_is_pinned_by_a_known_answer() -> None:
    # Written out independently of the implementation: blake2b-128, personalised, parent || int64 LE tokens.
    person = b"kvconnect-blk1"
    root = hashlib.blake2b(b"kvconnect-root1", digest_size=16, person=person).digest()
    k0 = hashlib.blake2b(root + np.array([1, 2], "<i8").tobytes(), digest_size=16, person=person).digest()
    k1 = hashlib.blake2b(k0 + np.array([3, -4], "<i8").tobytes(), digest_size=16, person=person).digest()
    assert block_keys([1, 2, 3, -4, 5], 2) == [k0, k1]
    assert root_key() == root


def test_keys_are_equal_in_another_process() -> None:
    code = "from kvconnect.offload.keys import block_keys; print([k.hex() for k in block_keys(range(100), 16)])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str([k.hex() for k in block_keys(range(100), 16)])


def test_salt_separates_caches_and_token_containers_do_not_matter() -> None:
    toks = list(range(32))
    assert block_keys(toks, 16, salt=b"lora-1") != block_keys(toks, 16)
    assert block_keys(np.array(toks, dtype=np.int32), 16) == block_keys(toks, 16) == block_keys(range(32), 16)
    assert block_keys(np.array(toks, dtype=np.uint16), 16) == block_keys(toks, 16)


@pytest.mark.parametrize(
    ("args", "message"),
    [(([1.5, 2.0], 1), "integers"), (([[1, 2]], 1), "flat"), (([1], 0), "block_size"),
     ((np.array([2**64 - 1], dtype=np.uint64), 1), "int64")],
)
def test_bad_tokens_are_refused(args, message) -> None:
    with pytest.raises(KVConnectError, match=message):
        block_keys(*args)


def test_engine_keys_may_be_any_hashable_but_not_none_or_unhashable() -> None:
    assert check_keys([b"a", "b", 3, (1, 2)]) == [b"a", "b", 3, (1, 2)]
    for bad in ([None], [[1]], [bytearray(b"x")], [(1, [2])]):
        with pytest.raises(KVConnectError, match="position 0"):
            check_keys(bad)
    with pytest.raises(KVConnectError, match="single str or bytes"):
        check_keys(b"abc")
