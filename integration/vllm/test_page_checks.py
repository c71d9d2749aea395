"""The e2e byte checks fail on a request that moved nothing: they must never pass on an empty dump."""

from __future__ import annotations

import numpy as np
import pytest

from pages import assert_pages_moved, assert_tp_pages


def _dump(path, arrays) -> None:
    np.savez(path, **arrays)


def _pages(blocks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (blocks, 64), dtype=np.uint8)


def test_pages_moved_passes_on_the_prefills_bytes_and_a_suffix_of_them(tmp_path) -> None:
    held = {"0:l0": _pages(3), "0:l1": _pages(3, 1)}
    _dump(tmp_path / "held-r.npz", held)
    _dump(tmp_path / "loaded-r.npz", {k: v[1:] for k, v in held.items()})
    assert_pages_moved(tmp_path, tmp_path, {"remote_request_id": "r", "remote_block_ids": [1, 2, 3]}, 1)
    with pytest.raises(AssertionError):
        assert_pages_moved(tmp_path, tmp_path, {"remote_request_id": "r"}, 1, loaded_blocks=[3])


def test_pages_moved_fails_when_decode_loaded_no_block_of_a_group(tmp_path) -> None:
    held = {"0:l0": _pages(2), "1:l1": _pages(2, 1)}
    _dump(tmp_path / "held-r.npz", held)
    _dump(tmp_path / "loaded-r.npz", {"0:l0": held["0:l0"], "1:l1": held["1:l1"][:0]})
    with pytest.raises(AssertionError, match="at least 1"):
        assert_pages_moved(tmp_path, tmp_path, {"remote_request_id": "r"}, 2)


def test_pages_moved_fails_on_empty_or_missing_dumps(tmp_path) -> None:
    _dump(tmp_path / "held-e.npz", {})
    _dump(tmp_path / "loaded-e.npz", {})
    with pytest.raises(AssertionError):
        assert_pages_moved(tmp_path, tmp_path, {"remote_request_id": "e"}, 1)
    with pytest.raises(AssertionError, match="no page dump"):
        assert_pages_moved(tmp_path, tmp_path, {"remote_request_id": "absent"}, 1)


def test_pages_moved_fails_when_prefill_held_fewer_blocks_than_it_handed_out(tmp_path) -> None:
    held = {"0:l0": _pages(2)}
    _dump(tmp_path / "held-r.npz", held)
    _dump(tmp_path / "loaded-r.npz", held)
    with pytest.raises(AssertionError, match="handed out"):
        assert_pages_moved(tmp_path, tmp_path, {"remote_request_id": "r", "remote_block_ids": [4, 5, 6]}, 1)


def test_tp_pages_fail_on_an_empty_dump_or_a_rank_without_blocks(tmp_path) -> None:
    whole = _pages(2)
    _dump(tmp_path / "held-r-rank0.npz", {"0:l": whole[:, :32]})
    _dump(tmp_path / "held-r-rank1.npz", {"0:l": whole[:, 32:]})
    _dump(tmp_path / "loaded-r.npz", {"0:l": whole})
    assert_tp_pages(tmp_path, 2, tmp_path, 1, "r")
    _dump(tmp_path / "loaded-r.npz", {"0:l": whole[:0]})
    with pytest.raises(AssertionError, match="loaded 0 blocks"):
        assert_tp_pages(tmp_path, 2, tmp_path, 1, "r")
    for name in ("held-x-rank0.npz", "held-x-rank1.npz", "loaded-x.npz"):
        _dump(tmp_path / name, {})
    with pytest.raises(AssertionError, match="no layers"):
        assert_tp_pages(tmp_path, 2, tmp_path, 1, "x")
