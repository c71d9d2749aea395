"""A digest of one request's pages and aux row, for checking what a decode loaded against what its
prefill held, byte for byte, without copying caches out of the servers.

With `KVCONNECT_SGLANG_PAGE_DIGESTS=1` the prefill logs the digest of the pages it holds for a room and
the decode the digest of the pages it loaded for that room (`kvconnect sglang digest room=R pages=N sha256=H
rank=K`, K the attention TP rank: with TP each rank holds its own heads of the room's pages).
"""

from __future__ import annotations

import hashlib
import logging
import os

import numpy as np

from kvconnect.integrations.sglang.buffers import Buffers

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether page digests are logged on this server."""
    return os.environ.get("KVCONNECT_SGLANG_PAGE_DIGESTS", "0") == "1"


def pages_digest(held: Buffers, pages: np.ndarray, aux: int) -> str:
    """sha256 over every KV buffer's pages (in order) and then every aux buffer's row, buffer by buffer."""
    h = hashlib.sha256()
    ids = {"kv": np.asarray(pages, dtype=np.int64), "aux": np.array([aux], dtype=np.int64)}
    for group in held.groups:
        for name in group.layers:
            h.update(held.tensors[name].numpy()[ids[group.label]].tobytes())
    return h.hexdigest()


def log_digest(held: Buffers, room: int, pages: np.ndarray, aux: int, rank: int = 0) -> None:
    """Log the room's digest on TP rank `rank` (only when enabled)."""
    if enabled():
        log.info("kvconnect sglang digest room=%d pages=%d sha256=%s rank=%d", room, len(pages),
                 pages_digest(held, pages, aux), rank)
