"""The layout model: stride orders, K/V views, Mamba pages and fingerprints."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect import LayoutError
from kvconnect.layout import KVCacheLayout, MambaPage, fingerprint, split_kv

NP_DTYPES = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
}


def test_layout_properties_follow_the_permutation() -> None:
    assert {lay.value for lay in KVCacheLayout} == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert [lay.value for lay in KVCacheLayout if lay.layers_outermost] == ["LBHNC", "LBNHC", "LHBNC"]
    assert [lay.value for lay in KVCacheLayout if lay.blocks_outermost] == ["BLHNC", "BLNHC", "BHLNC"]
    assert [lay.value for lay in KVCacheLayout if lay.block_contiguous] == ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_per_layer_views_place_every_element_where_the_permutation_says(layout: KVCacheLayout) -> None:
    shape = (3, 5, 2, 4, 6)
    buf = torch.arange(int(np.prod(shape)), dtype=torch.int64)
    views = layout.per_layer_views(buf, shape)
    # Independent reference: a C-ordered array in physical order, transposed back to logical order.
    phys_shape = [shape["LBHNC".index(d)] for d in layout.value]
    ref = np.arange(int(np.prod(shape))).reshape(phys_shape).transpose([layout.value.index(d) for d in "LBHNC"])
    for layer, view in enumerate(views):
        np.testing.assert_array_equal(view.numpy(), ref[layer])
    # Views alias the buffer: no copy was made.
    views[1][2, 1, 3, 5] = -7
    assert int(buf[int(ref[1][2, 1, 3, 5])]) == -7


def test_per_layer_views_reject_a_buffer_of_the_wrong_size() -> None:
    with pytest.raises(LayoutError, match="240 elements"):
        KVCacheLayout.LBHNC.per_layer_views(torch.zeros(10), (2, 3, 2, 2, 10))


def test_split_kv_returns_views_of_the_packed_page() -> None:
    pages = torch.arange(2 * 3 * 4 * 8, dtype=torch.float32).reshape(2, 3, 4, 8)
    k, v = split_kv(pages, head_size=4)
    assert k.data_ptr() == pages.data_ptr()
    torch.testing.assert_close(k, pages[..., :4])
    torch.testing.assert_close(v, pages[..., 4:])
    v.fill_(-1)
    assert bool((pages[..., 4:] == -1).all()) and not bool((pages[..., :4] == -1).any())


def test_split_kv_rejects_a_content_dim_that_is_not_two_heads() -> None:
    with pytest.raises(LayoutError, match="2\\*head_size=10"):
        split_kv(torch.zeros(2, 3, 4, 8), head_size=5)


def _reference_unpack(page_bytes: bytes, shapes, dtypes) -> list[np.ndarray]:
    """Independent reading of one page: states back to back from byte 0, decoded by numpy."""
    out, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        npd = np.dtype(NP_DTYPES[dtype])
        n = int(np.prod(shape)) * npd.itemsize
        out.append(np.frombuffer(page_bytes[offset: offset + n], dtype=npd).reshape(shape))
        offset += n
    return out


@st.composite
def mamba_specs(draw):
    n_states = draw(st.integers(1, 3))
    # Larger item sizes first keeps every state aligned, as real conv/ssm state packs are.
    dtypes = sorted(draw(st.lists(st.sampled_from(list(NP_DTYPES)), min_size=n_states, max_size=n_states)),
                    key=lambda d: -d.itemsize)
    shapes = [tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))) for _ in range(n_states)]
    used = sum(int(np.prod(s)) * d.itemsize for s, d in zip(shapes, dtypes))
    page = -(-used // 8) * 8 + draw(st.integers(0, 3)) * 8  # real pages are padded to the widest item
    return shapes, dtypes, page, draw(st.integers(1, 4)), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=200, deadline=None)
@given(mamba_specs())
def test_mamba_unpack_matches_an_independent_reference(spec) -> None:
    shapes, dtypes, page_size, num_blocks, seed = spec
    mp = MambaPage(shapes, dtypes, page_size)
    pages = torch.randint(-128, 128, (num_blocks, 1, 1, page_size), dtype=torch.int8,
                          generator=torch.Generator().manual_seed(seed))
    views = mp.unpack(pages)
    assert mp.state_bytes == sum(int(np.prod(s)) * d.itemsize for s, d in zip(shapes, dtypes))
    for b in range(num_blocks):
        ref = _reference_unpack(pages[b, 0, 0].numpy().tobytes(), shapes, dtypes)
        for view, expected, shape, dtype in zip(views, ref, shapes, dtypes):
            assert view.shape == (num_blocks, *shape) and view.dtype == dtype
            np.testing.assert_array_equal(view[b].numpy().view(np.uint8), expected.view(np.uint8))


def test_mamba_state_views_write_through_to_the_page_bytes() -> None:
    mp = MambaPage([(2, 3), (4,)], [torch.float32, torch.int16], page_size_bytes=64)
    pages = torch.zeros(3, 1, 1, 64, dtype=torch.int8)
    conv, ssm = mp.unpack(pages)
    conv[1].fill_(1.5)
    ssm[2, 3] = 0x0102
    assert np.frombuffer(pages[1, 0, 0, :24].numpy().tobytes(), dtype=np.float32).tolist() == [1.5] * 6
    assert pages[2, 0, 0, 24 + 6: 24 + 8].numpy().tolist() == [2, 1]  # little-endian 0x0102
    assert int(pages[0].abs().sum()) == 0 and int(pages[1, 0, 0, 24:].abs().sum()) == 0


def test_mamba_unpack_works_on_a_strided_page_view_of_a_bigger_buffer() -> None:
    mp = MambaPage([(4,)], [torch.float32], page_size_bytes=16)
    big = torch.zeros(5, 1, 1, 32, dtype=torch.int8)
    (state,) = mp.unpack(big[..., 16:])
    state.fill_(2.0)
    assert int(big[..., :16].abs().sum()) == 0
    assert np.frombuffer(big[0, 0, 0, 16:].numpy().tobytes(), dtype=np.float32).tolist() == [2.0] * 4


@pytest.mark.parametrize(
    ("args", "pages", "message"),
    [
        (([(10,)], [torch.float32], 16), None, "need 40 bytes but the page has 16"),
        (([(2,), (2,)], [torch.float32], 64), None, "2 shapes but 1 dtypes"),
        (([], [], 64), None, "at least one state"),
        (([(2,)], [torch.float32], 0), None, "must be positive"),
        (([(0, 2)], [torch.float32], 64), None, "non-positive dim"),
        (([(3,), (1,)], [torch.int8, torch.float32], 64), None, "starts at byte 3"),
        (([(2,)], ["float32"], 64), None, "must be a torch.dtype"),
        (([(2,)], [torch.float32], 64), torch.zeros(2, 1, 1, 16, dtype=torch.float32), "int8 or uint8"),
        (([(2,)], [torch.float32], 64), torch.zeros(2, 64, dtype=torch.int8), "shape \\[num_blocks, 1, 1"),
        (([(2,)], [torch.float32], 64), torch.zeros(2, 1, 1, 32, dtype=torch.int8), "page has 32 bytes"),
        (([(2,)], [torch.float32], 64), torch.zeros(2, 1, 1, 64, dtype=torch.int8).transpose(0, 3)
         .contiguous().transpose(0, 3), "contiguous"),
        (([(2,)], [torch.float32], 8), torch.zeros(4, 1, 1, 9, dtype=torch.int8)[..., 1:], "page stride 9"),
    ],
)
def test_mamba_page_rejects_bad_input_with_a_message_naming_the_problem(args, pages, message) -> None:
    with pytest.raises(LayoutError, match=message):
        mp = MambaPage(*args)
        mp.unpack(pages)


def test_fingerprint_is_stable_across_processes_and_sensitive_to_each_field() -> None:
    fields = dict(layout=KVCacheLayout.LBHNC, dtype=torch.bfloat16, block_size=16, heads=8, head_size=128)
    fp = fingerprint(**fields)
    code = ("import torch; from kvconnect.layout import fingerprint, KVCacheLayout; "
            "print(fingerprint(head_size=128, heads=8, block_size=16, dtype=torch.bfloat16, "
            "layout=KVCacheLayout.LBHNC))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == fp
    for key, value in [("layout", KVCacheLayout.BLHNC), ("dtype", torch.float16), ("block_size", 32),
                       ("heads", 4), ("head_size", 64)]:
        assert fingerprint(**{**fields, key: value}) != fp, key


def test_fingerprint_refuses_values_it_cannot_make_stable() -> None:
    with pytest.raises(LayoutError, match="object"):
        fingerprint(x=object())
