"""Vectored file I/O that finishes the job: `pwritev` and `preadv` looped until every byte moved.

The kernel may move fewer bytes than asked and takes at most `IOV_MAX` buffers per call; these
helpers chunk the buffers and resume after a short transfer, so callers see one call per batch.
"""

from __future__ import annotations

import os

IOV_MAX = 1024


def write_all(fd: int, views: list[memoryview], offset: int) -> None:
    """pwritev until every byte is written (the kernel may write less, and takes at most IOV_MAX buffers)."""
    for i in range(0, len(views), IOV_MAX):
        chunk = views[i:i + IOV_MAX]
        left = sum(v.nbytes for v in chunk)
        while left:
            n = os.pwritev(fd, chunk, offset)
            offset, left = offset + n, left - n
            chunk = _advance(chunk, n)


def read_all(fd: int, views: list[memoryview], offset: int) -> int:
    """preadv until the buffers are full or the file ends; bytes read."""
    total = 0
    for i in range(0, len(views), IOV_MAX):
        chunk = views[i:i + IOV_MAX]
        left = sum(v.nbytes for v in chunk)
        while left:
            n = os.preadv(fd, chunk, offset)
            if n == 0:
                return total
            offset, left, total = offset + n, left - n, total + n
            chunk = _advance(chunk, n)
    return total


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The buffers after the first `n` bytes."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views
