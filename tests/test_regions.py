"""Regions from registered KV caches, and the descriptors every transfer is built from."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import copy_rows, kv_cache, random_bytes_
from kvconnect import BlockRangeError, LayoutError
from kvconnect.layout import KVCacheLayout, MambaPage
from kvconnect.descriptors import block_rows, pair_descriptors
from kvconnect.regions import MemoryKind, Region, RegionSet

CONTIGUOUS_LAYOUTS = [lay for lay in KVCacheLayout if lay.block_contiguous]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64]


@st.composite
def transfers(draw):
    layout = draw(st.sampled_from(CONTIGUOUS_LAYOUTS))
    cross_layer = layout.blocks_outermost and draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    L, H, N, C = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 8))
    src_blocks, dst_blocks = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    n = draw(st.integers(0, min(src_blocks, dst_blocks)))
    # Runs are what coalescing feeds on, so draw tables that mix runs and jumps.
    src_ids = draw(st.permutations(range(src_blocks)))[:n] if draw(st.booleans()) else list(range(src_blocks))[:n]
    dst_ids = draw(st.permutations(range(dst_blocks)))[:n] if draw(st.booleans()) else list(range(dst_blocks))[-n:] if n else []
    return layout, cross_layer, dtype, (L, H, N, C), src_blocks, dst_blocks, src_ids, dst_ids, draw(st.integers(0, 999))


def _caches(layout, cross_layer, dtype, dims, blocks, seed):
    L, H, N, C = dims
    buf, layers = kv_cache(layout, (L, blocks, H, N, C), dtype, seed)
    if cross_layer:
        phys = [dict(zip("LBHNC", (L, blocks, H, N, C)))[d] for d in layout.value]
        return buf, layers, {"all_layers": buf.view(phys)}
    return buf, layers, layers


@settings(max_examples=300, deadline=None)
@given(transfers())
def test_copy_through_coalesced_descriptors_equals_block_by_block_copy(case) -> None:
    layout, cross_layer, dtype, dims, src_blocks, dst_blocks, src_ids, dst_ids, seed = case
    src_buf, src_layers, src_reg = _caches(layout, cross_layer, dtype, dims, src_blocks, seed)
    dst_buf, dst_layers, dst_reg = _caches(layout, cross_layer, dtype, dims, dst_blocks, seed + 1)
    expected = dst_buf.clone()
    ref_layers = layout.per_layer_views(expected, (dims[0], dst_blocks, *dims[1:]))
    for ref, src in zip(ref_layers, src_layers.values()):
        for d, s in zip(dst_ids, src_ids):
            ref[d].copy_(src[s])

    src_rs, dst_rs = RegionSet.from_kv_caches(src_reg), RegionSet.from_kv_caches(dst_reg)
    dst_desc, src_desc = pair_descriptors(dst_rs, dst_ids, src_rs, src_ids)
    copy_rows(dst_desc, src_desc)

    assert torch.equal(dst_buf.view(torch.uint8), expected.view(torch.uint8))
    runs = 1 + int(np.count_nonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1))) if src_ids else 0
    if cross_layer:
        assert len(dst_desc) == runs
    elif layout.layers_outermost or dims[0] == 1:  # one layer: blocks are back to back either way
        assert len(dst_desc) == dims[0] * runs
    else:
        assert len(dst_desc) == dims[0] * len(src_ids)


@settings(max_examples=100, deadline=None)
@given(transfers())
def test_single_side_descriptors_cover_exactly_the_named_blocks(case) -> None:
    layout, cross_layer, dtype, dims, _, blocks, _, ids, seed = case
    buf, layers, reg = _caches(layout, cross_layer, dtype, dims, blocks, seed)
    rs = RegionSet.from_kv_caches(reg)
    desc = block_rows(rs, ids)
    assert desc.dtype == np.uint64 and desc.shape[1] == 3
    base = buf.data_ptr()
    covered = np.zeros(buf.numel() * buf.element_size(), dtype=bool)
    for addr, nbytes, dev in desc.tolist():
        assert dev == 0 and not covered[addr - base: addr - base + nbytes].any(), "descriptor overlap"
        covered[addr - base: addr - base + nbytes] = True
    marker = torch.zeros_like(buf)
    marks = layout.per_layer_views(marker, (dims[0], blocks, *dims[1:]))
    for view in marks:
        view[list(ids)] = 1
    assert np.array_equal(covered, marker.view(torch.uint8).numpy().astype(bool).reshape(-1, buf.element_size()).any(1).repeat(buf.element_size()))


def test_layers_viewing_one_buffer_become_one_region_each_and_register_once(llama_like_cache) -> None:
    buf, layers = llama_like_cache
    rs = RegionSet.from_kv_caches(layers)
    assert len(rs) == 4 and rs.names == list(layers)
    page = 2 * 16 * 128 * 2
    assert all(r.block_bytes == page and r.block_stride == page and r.contiguous for r in rs)
    assert rs.registration().tolist() == [[buf.data_ptr(), buf.numel() * 2, 0]]
    assert {r.memory_kind for r in rs} == {MemoryKind.DRAM}


def test_strided_per_layer_views_are_accepted_and_move_block_by_block() -> None:
    buf, layers = kv_cache(KVCacheLayout.BLHNC, (3, 8, 2, 4, 8), torch.float16, seed=3)
    rs = RegionSet.from_kv_caches(layers)
    assert [r.block_stride for r in rs] == [3 * 2 * 4 * 8 * 2] * 3
    assert not any(r.contiguous for r in rs)
    assert len(block_rows(rs, [2, 3, 4])) == 9
    assert rs.registration().shape == (1, 3)


def test_a_cross_layer_tensor_is_one_region() -> None:
    cache = torch.zeros(10, 4, 2, 16, 64, dtype=torch.bfloat16)
    rs = RegionSet.from_kv_caches({"cross": cache})
    (region,) = rs.regions
    assert region.num_blocks == 10 and region.block_bytes == 4 * 2 * 16 * 64 * 2
    assert block_rows(rs, [3, 4, 5]).tolist() == [[cache.data_ptr() + 3 * region.block_bytes, 3 * region.block_bytes, 0]]


def test_aliased_layers_share_one_region_and_keep_all_names() -> None:
    raw = torch.zeros(6, 1024, dtype=torch.int8)
    attn = raw.view(torch.float16).view(6, 2, 16, 16)  # 1024 bytes per block
    mamba = raw[:, :768].view(6, 1, 1, 768)  # a Mamba page view of the same blocks, narrower
    rs = RegionSet.from_kv_caches({"layers.0.attn": attn, "layers.0.mamba": mamba, "layers.0.again": attn})
    (region,) = rs.regions
    assert region.names == ("layers.0.attn", "layers.0.mamba", "layers.0.again")
    assert region.block_bytes == 1024


def test_hybrid_attention_and_mamba_pages_move_byte_exact() -> None:
    mp = MambaPage([(4, 8), (2, 8, 4)], [torch.float32, torch.float16], page_size_bytes=256)
    def make(blocks: int, seed: int):
        attn = random_bytes_(torch.empty(blocks, 2, 4, 16, dtype=torch.bfloat16), seed)
        ssm = random_bytes_(torch.empty(blocks, 1, 1, 256, dtype=torch.int8), seed + 1)
        return {"l0.attn": attn, "l1.mamba": ssm}, attn, ssm
    src, s_attn, s_ssm = make(8, 10)
    dst, d_attn, d_ssm = make(12, 20)
    before = d_ssm.clone()
    local, remote = pair_descriptors(RegionSet.from_kv_caches(dst), [9, 10, 0], RegionSet.from_kv_caches(src), [1, 2, 7])
    copy_rows(local, remote)
    assert torch.equal(d_attn[[9, 10, 0]], s_attn[[1, 2, 7]])
    for d_state, s_state in zip(mp.unpack(d_ssm), mp.unpack(s_ssm)):
        assert torch.equal(d_state[[9, 10, 0]].view(torch.uint8), s_state[[1, 2, 7]].view(torch.uint8))
    untouched = [i for i in range(12) if i not in (9, 10, 0)]
    assert torch.equal(d_ssm[untouched], before[untouched])


def test_region_subset_selects_one_kv_group() -> None:
    rs = RegionSet.from_kv_caches({"a": torch.zeros(4, 8), "b": torch.zeros(16, 8)})
    desc = block_rows(rs, [12, 13], regions=[1])
    assert desc.tolist() == [[rs[1].base_addr + 12 * 32, 64, 0]]
    with pytest.raises(BlockRangeError, match="region a"):
        block_rows(rs, [12])
    with pytest.raises(LayoutError, match="region index"):
        block_rows(rs, [0], regions=[2])


def test_non_contiguous_block_bytes_are_refused_naming_the_layer() -> None:
    t = torch.zeros(16, 10).t()  # blocks along a strided dim: each block's bytes are scattered
    with pytest.raises(LayoutError, match="layer kv.3: the bytes of one block are not one contiguous run"):
        RegionSet.from_kv_caches({"kv.3": t})


def test_lhbnc_per_layer_views_are_refused() -> None:
    _, layers = kv_cache(KVCacheLayout.LHBNC, (2, 4, 2, 4, 8), torch.float16, seed=0)
    with pytest.raises(LayoutError, match="not one contiguous run"):
        RegionSet.from_kv_caches(layers)


def test_overlapping_blocks_are_refused_as_not_blocks_first() -> None:
    t = torch.zeros(64).as_strided((10, 8), (4, 1))
    with pytest.raises(LayoutError, match="layer x: blocks are not outermost"):
        RegionSet.from_kv_caches({"x": t})


def test_partially_overlapping_layers_are_refused() -> None:
    buf = torch.zeros(100)
    with pytest.raises(LayoutError, match="overlap in memory"):
        RegionSet.from_kv_caches({"a": buf[:80].view(10, 8), "b": buf[4:84].view(10, 8)})


@pytest.mark.parametrize(
    ("kv", "message"),
    [({}, "no tensors"), ({"x": torch.zeros(0, 4)}, "empty"), ({"x": torch.tensor(1.0)}, "0-d"),
     ({"x": [1, 2]}, "expected a torch.Tensor"), ({"x": torch.zeros(4, 4, device="meta")}, "unsupported device")],
)
def test_bad_kv_cache_input_is_refused_with_a_layout_error(kv, message) -> None:
    with pytest.raises(LayoutError, match=message):
        RegionSet.from_kv_caches(kv)


@pytest.mark.parametrize(
    ("ids", "message"),
    [([0, 3, 8], "block id 8 at position 2 is out of range for region layer.0 \\(num_blocks=8\\)"),
     ([-1], "block id -1 at position 0"),
     ([1, 2.5], "must be integers: 2.5 at position 1"),
     ([True, False], "must be integers: True at position 0"),
     (["1"], "must be integers"),
     ([[1, 2]], "flat sequence"),
     (np.array([2**63 + 5], dtype=np.uint64), "out of range")],
)
def test_invalid_block_ids_raise_block_range_error_naming_id_and_region(ids, message) -> None:
    rs = RegionSet.from_kv_caches({"layer.0": torch.zeros(8, 16), "layer.1": torch.zeros(9, 16)})
    with pytest.raises(BlockRangeError, match=message):
        block_rows(rs, ids)


def test_block_ids_may_come_as_tensors_arrays_or_ranges() -> None:
    rs = RegionSet.from_kv_caches({"l": torch.zeros(8, 16)})
    expected = block_rows(rs, [1, 2, 5]).tolist()
    for ids in (torch.tensor([1, 2, 5]), np.array([1, 2, 5], dtype=np.int32), np.array([1, 2, 5], dtype=np.uint16)):
        assert block_rows(rs, ids).tolist() == expected
    assert block_rows(rs, range(2, 5)).tolist() == [[rs[0].base_addr + 128, 192, 0]]
    assert block_rows(rs, []).shape == (0, 3)


def test_pairs_need_equal_lengths_and_equal_block_sizes() -> None:
    a = RegionSet.from_kv_caches({"l": torch.zeros(8, 16)})
    b = RegionSet.from_kv_caches({"l": torch.zeros(8, 8)})
    with pytest.raises(BlockRangeError, match="2 local block ids but 1 remote"):
        pair_descriptors(a, [1, 2], a, [1])
    with pytest.raises(LayoutError, match="local blocks are 64 bytes, peer blocks are 32 bytes"):
        pair_descriptors(a, [1], b, [1])
    with pytest.raises(LayoutError, match="local has 1 regions, peer has 2"):
        pair_descriptors(a, [1], RegionSet.from_kv_caches({"x": torch.zeros(8, 16), "y": torch.zeros(8, 16)}), [1])
    with pytest.raises(BlockRangeError, match="block id 9"):
        pair_descriptors(a, [1], a, [9])


def test_runs_merge_only_where_both_sides_are_consecutive() -> None:
    a = RegionSet.from_kv_caches({"l": torch.zeros(32, 16)})
    b = RegionSet.from_kv_caches({"l": torch.zeros(32, 16)})
    local, remote = pair_descriptors(a, [0, 1, 2, 3], b, [5, 6, 9, 10])
    assert local[:, 1].tolist() == [128, 128] and remote[:, 1].tolist() == [128, 128]
    assert (remote[:, 0] - b[0].base_addr).tolist() == [5 * 64, 9 * 64]


def test_region_rejects_inconsistent_geometry() -> None:
    with pytest.raises(LayoutError, match="would overlap"):
        Region(("x",), 4096, 4, 64, 32, 0, MemoryKind.DRAM)
    with pytest.raises(LayoutError, match="positive"):
        Region(("x",), 4096, 0, 64, 64, 0, MemoryKind.DRAM)


def test_a_region_set_keeps_its_tensors_alive_and_pickles_geometry_only() -> None:
    import pickle

    rs = RegionSet.from_kv_caches({"l": torch.arange(64, dtype=torch.float32).view(4, 16)})
    # The tensor above has no other owner: the set must keep it, or a transport would write freed memory.
    (kept,) = rs._tensors
    assert kept.data_ptr() == rs[0].base_addr and float(kept[3, 15]) == 63.0
    clone = pickle.loads(pickle.dumps(rs))
    assert clone.regions == rs.regions and clone._tensors == ()
    assert kept.data_ptr() == rs[0].base_addr  # pickling did not move the storage


def test_per_layer_views_of_a_blocks_outermost_buffer_merge_into_one_region_per_group() -> None:
    from kvconnect.layout import KVCacheLayout

    shape = (4, 16, 2, 8, 32)  # L, B, H, N, C
    buf = torch.arange(int(np.prod(shape)), dtype=torch.float32)
    views = KVCacheLayout.BLHNC.per_layer_views(buf, shape)
    caches = {f"layer.{i}": v for i, v in enumerate(views)}
    per_layer = RegionSet.from_kv_caches(caches)
    merged = RegionSet.from_kv_caches(caches, layer_groups=[list(caches)])
    assert len(per_layer) == 4 and len(merged) == 1
    page = 2 * 8 * 32 * 4
    assert merged[0].block_bytes == 4 * page and merged[0].block_stride == 4 * page
    ids = [3, 7, 11]
    # One descriptor per block for every layer, where per-layer regions need one per block and layer.
    assert len(block_rows(per_layer, ids)) == 12 and len(block_rows(merged, ids)) == 3
    rows = block_rows(merged, ids)
    got = np.concatenate([np.frombuffer(ctypes.string_at(int(a), int(n)), dtype=np.float32) for a, n, _ in rows])
    want = torch.cat([torch.cat([v[b].reshape(-1) for v in views]) for b in ids]).numpy()
    assert np.array_equal(got, want)
    # Layers of different groups never merge: a block id of one group says nothing of the other's pages.
    split = RegionSet.from_kv_caches(caches, layer_groups=[["layer.0", "layer.1"], ["layer.2", "layer.3"]])
    assert [r.names for r in split] == [("layer.0", "layer.1"), ("layer.2", "layer.3")]
