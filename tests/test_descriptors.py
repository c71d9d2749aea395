"""Block ids checked once into values that say so, selections and pairings, runs, and names that moved."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvconnect import BlockRangeError, LayoutError
from kvconnect.descriptors import (
    CheckedIds,
    Pairing,
    block_rows,
    block_table,
    check_ids,
    pair_descriptors,
    select,
    slice_descriptors,
    table_indices,
)
from kvconnect.errors import LocalInvalid, PeerUnreachable, RemoteRejected, TransferError, TransferTimeout
from kvconnect.regions import MemoryKind, Region, RegionSet
from kvconnect.runs import runs


def _set(*blocks: int, width: int = 16) -> RegionSet:
    return RegionSet.from_kv_caches({f"l{i}": torch.zeros(n, width) for i, n in enumerate(blocks)})


def test_checked_ids_are_read_only_and_not_checked_again_for_the_same_regions() -> None:
    rs = _set(8, 8)
    raw = np.array([1, 2, 7])
    ids = check_ids(rs, raw)
    assert isinstance(ids, CheckedIds) and not ids.flags.writeable
    raw[0] = 99  # the caller's array is not the checked one
    assert ids.tolist() == [1, 2, 7]
    assert check_ids(rs, ids) is ids and check_ids(rs, ids, [1]) is ids
    assert check_ids(_set(8, 8), ids) is not ids  # another set: checked again
    with pytest.raises(BlockRangeError, match="block id 9"):
        check_ids(rs, ids + 2)  # derived ids are plain ids again


def test_ids_checked_for_some_regions_are_checked_again_for_others() -> None:
    rs = _set(8, 4)
    ids = check_ids(rs, [5], [0])
    with pytest.raises(BlockRangeError, match="out of range for region l1"):
        check_ids(rs, ids, [0, 1])


@pytest.mark.parametrize(("op", "lids", "rids", "side"), [("READ", [3, 3], [1, 2], "local"),
                                                          ("WRITE", [1, 2], [4, 4], "remote")])
def test_a_destination_named_twice_is_refused(op, lids, rids, side) -> None:
    rs = _set(8)
    with pytest.raises(BlockRangeError, match=f"names {side} block"):
        select(op, rs, lids, rs, rids)
    reverse = "WRITE" if op == "READ" else "READ"
    assert select(reverse, rs, lids, rs, rids).blocks == 2  # sources may repeat


def test_selection_checks_op_counts_and_narrows_to_its_own_regions_only() -> None:
    rs = _set(8, 8)
    with pytest.raises(LocalInvalid, match="unknown transfer op"):
        select("COPY", rs, [0], rs, [0])
    with pytest.raises(BlockRangeError, match="2 local block ids but 1 remote"):
        select("READ", rs, [0, 1], rs, [0])
    sel = select("READ", rs, [0, 1], rs, [2, 3], regions=[1])
    assert sel.only([1]).blocks == 2
    with pytest.raises(LayoutError, match="not all among the selected"):
        sel.only([0])
    with pytest.raises(LayoutError, match="named twice"):
        select("READ", rs, [0], rs, [1], regions=[1, 1])  # would move each block twice
    chosen = np.array([1])
    sel = select("READ", rs, [0], rs, [1], regions=chosen)
    chosen[0] = -1  # the caller's array is not the checked one
    assert sel.regions.tolist() == [1]


def test_a_pairing_checks_block_bytes_once_and_admits_only_selections_of_its_sets() -> None:
    a, b = _set(8), _set(8)
    with pytest.raises(LayoutError, match="local blocks are 64 bytes, peer blocks are 32 bytes"):
        Pairing(a, _set(8, width=8))
    with pytest.raises(LayoutError, match="local has 1 regions, peer has 2"):
        Pairing(a, _set(8, 8))
    pairing = Pairing(a, b)
    pairing.admit(pairing.select("READ", [0], [1]))
    with pytest.raises(LocalInvalid, match="other regions"):
        pairing.admit(select("READ", a, [0], _set(8), [1]))
    local, remote = pairing.rows(pairing.select("READ", [0, 1], [4, 5]))
    assert local.tolist() == [[a[0].base_addr, 128, 0]] and remote.tolist() == [[b[0].base_addr + 256, 128, 0]]


def test_slices_that_run_past_a_block_are_refused_when_paired() -> None:
    a = _set(8)
    with pytest.raises(LayoutError, match="runs past a block"):
        Pairing(a, a, {0: (np.array([0]), np.array([60]), np.array([8]))})
    with pytest.raises(LayoutError, match="outside"):
        Pairing(a, a, {3: (np.array([0]), np.array([0]), np.array([8]))})
    rows_l, rows_r = slice_descriptors(a, [0, 1], a, [2, 3], {0: (np.array([0]), np.array([32]), np.array([32]))})
    assert rows_l[:, 1].tolist() == [32, 32] and (rows_r[:, 0] - a[0].base_addr).tolist() == [2 * 64 + 32, 3 * 64 + 32]


def test_slices_that_leave_out_a_selected_region_are_refused_rather_than_moving_less() -> None:
    two = _set(8, 8)
    half = (np.array([0]), np.array([0]), np.array([32]))
    with pytest.raises(LayoutError, match="no byte ranges for region 1"):
        slice_descriptors(two, [0], two, [1], {0: half})
    none = (np.zeros(0, np.int64),) * 3  # a peer rank that holds none of a region: nothing to move there
    rows_l, _ = slice_descriptors(two, [0], two, [1], {0: half, 1: none})
    assert rows_l.shape == (1, 3)


def test_pair_descriptors_allows_repeated_ids_as_before() -> None:
    a = _set(8)
    local, remote = pair_descriptors(a, [1, 1], a, [2, 3])
    assert local.shape == remote.shape == (2, 3)


def test_block_table_and_indices_match_rows_built_block_by_block() -> None:
    rs = RegionSet([Region(("a",), 1 << 30, 3, 64, 128, 0, MemoryKind.DRAM),
                    Region(("b",), 1 << 31, 2, 32, 32, 1, MemoryKind.DRAM)])
    rows, offsets = block_table(rs)
    want = [[(1 << 30) + i * 128, 64, 0] for i in range(3)] + [[(1 << 31) + i * 32, 32, 1] for i in range(2)]
    assert rows.tolist() == want and offsets.tolist() == [0, 3]
    idx = table_indices(offsets, np.array([1, 0]), np.array([1, 0]))
    assert idx.dtype == np.int32 and rows[idx].tolist() == [want[4], want[3], want[1], want[0]]
    assert block_rows(rs, [0, 1], [1]).tolist() == [[1 << 31, 64, 1]]


def test_runs_join_entries_that_continue_each_other_on_every_side() -> None:
    first, count = runs(np.array([1, 2, 3, 7, 8]), np.array([5, 6, 9, 10, 11]))
    assert first.tolist() == [0, 2, 3] and count.tolist() == [2, 1, 2]
    first, count = runs(np.array([0, 8, 16], dtype=np.uint64), step=np.array([8, 8, 8], dtype=np.uint64),
                        apart=np.array([False, True]))
    assert first.tolist() == [0, 2] and count.tolist() == [2, 1]
    assert runs(np.empty(0, np.int64))[0].size == 0


def test_names_that_moved_keep_working_or_name_their_new_home() -> None:
    import kvconnect.kvgroups
    import kvconnect.regions

    assert kvconnect.regions.KVGroup is kvconnect.kvgroups.KVGroup
    with pytest.raises(ImportError, match="kvconnect.descriptors.slice_descriptors"):
        from kvconnect.shards import slice_descriptors  # noqa: F401
    with pytest.raises(ImportError, match="kvconnect.region_splits.assign_shards"):
        from kvconnect.shards import assign_shards  # noqa: F401
    with pytest.raises(ImportError, match="kvconnect.descriptors.pair_descriptors"):
        from kvconnect.regions import pair_descriptors  # noqa: F401
    with pytest.raises(ImportError, match="kvconnect.transport.make_transport"):
        from kvconnect.transport.options import make_transport  # noqa: F401
    with pytest.raises(AttributeError, match="check_ids"):
        _set(4).validate([0])
    with pytest.raises(AttributeError, match="block_rows"):
        _set(4).descriptors([0])


def test_backend_errors_map_to_the_most_specific_kind() -> None:
    from kvconnect.transport.mooncake_errors import check_rc, failed_batch_kind
    from kvconnect.transport.nixl_errors import nixl_errors

    def raised(name: str, base: type = Exception) -> type:
        return type(name, (base,), {})

    for name, kind in [("nixlRemoteDisconnectError", PeerUnreachable), ("nixlNotFoundError", RemoteRejected),
                       ("nixlInvalidParamError", LocalInvalid), ("nixlBackendError", TransferError)]:
        with pytest.raises(kind, match=f"NIXL posting: {name}"):
            with nixl_errors("posting"):
                raise raised(name)("boom")
    with pytest.raises(TransferTimeout):
        with nixl_errors("waiting"):
            raise TimeoutError("late")
    with pytest.raises(LocalInvalid):
        check_rc(-1, "could not register")
    with pytest.raises(PeerUnreachable):
        check_rc(-101, "socket")
    assert failed_batch_kind(-1, 0.1) == "unreachable" and failed_batch_kind(-1, 1e9) == "timeout"


def test_a_failed_mooncake_batch_is_a_timeout_from_the_earliest_of_mooncakes_deadlines(monkeypatch) -> None:
    from kvconnect.transport.mooncake_errors import failed_batch_kind

    # Mooncake's TCP sessions drop a connection with no progress after 30 s whatever MC_TRANSFER_TIMEOUT
    # says: a batch that failed then timed out; it did not find its peer unreachable.
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "240")
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC", raising=False)
    monkeypatch.delenv("MC_TCP_STATUS_TIMEOUT_SEC", raising=False)
    assert failed_batch_kind(-1, 30.0) == "timeout"
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "240")
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "240")
    assert failed_batch_kind(-1, 30.0) == "unreachable" and failed_batch_kind(-1, 240.0) == "timeout"
