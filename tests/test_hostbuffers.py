"""The tiers' host buffers start on a page, whatever offset the allocator hands out."""

from __future__ import annotations

import numpy as np

from kvconnect.offload.tiers.hostbuffers import PAGE, aligned, page_rows


def test_an_aligned_array_starts_on_a_page_and_is_contiguous_and_zeroed():
    for shape in [(1,), (3, 5000), (7, 16, 1024)]:
        arr = aligned(shape)
        assert arr.shape == shape and arr.ctypes.data % PAGE == 0
        assert arr.flags.c_contiguous and not arr.any()


def test_every_staging_row_starts_on_a_page_and_the_padded_span_is_writable():
    rows = page_rows(5, 65536 + 16)
    assert rows.shape == (5, 65536 + 16) and rows.strides[0] % PAGE == 0
    starts = rows.ctypes.data + np.arange(5) * rows.strides[0]
    assert (starts % PAGE == 0).all()
    # What a registration of the whole span covers belongs to the array: writing it faults nothing.
    whole = np.lib.stride_tricks.as_strided(rows, shape=(rows.strides[0] * rows.shape[0],), strides=(1,))
    whole[-1] = 1
    assert rows[-1, -1] == 0  # the padding, not a row's byte
