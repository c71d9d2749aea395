"""Host buffers that the tiers move bytes through, starting on a page.

A large numpy array starts 16 bytes into a page (glibc's header before an mmap'd block), and on
some hosts (AMD EPYC here) the kernel copies into a buffer at that offset at a tenth of its usual
speed: a file read into it ran at 2.7 GB/s against 20 GB/s for the same read into a page-aligned
buffer. The engine's pool is torch's, 64-byte aligned, and copies at full speed; the tiers' own
staging rows, and the bench's pools and baselines, start on a page so that they do too.
"""

from __future__ import annotations

import numpy as np

PAGE = 4096


def aligned(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed, contiguous uint8 array of `shape` that starts on a page."""
    size = int(np.prod(shape))
    raw = np.zeros(size + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start:start + size].reshape(shape)


def page_rows(rows: int, width: int) -> np.ndarray:
    """A zeroed `(rows, width)` uint8 array whose every row starts on a page (rows padded to pages;
    `strides[0] * rows` bytes from its start are its own, for registering it whole)."""
    stride = -(-width // PAGE) * PAGE
    return aligned((rows, stride))[:, :width]
