"""A digest of one request's pages and aux row, for checking what a decode loaded against what its
prefill held, byte for byte, without copying caches out of the servers.

With `KVCONNECT_SGLANG_PAGE_DIGESTS=1` the prefill logs the digest of the pages it holds for a room and
the decode the digest of the pages it loaded for that room (`kvconnect sglang digest room=R pages=N sha256=H
rank=K`, K the attention TP rank: with TP each rank holds its own heads of the room's pages). Where pages
split by head, each side also logs a digest per global KV head over every KV buffer's pages, and one of
the aux rows (`kvconnect sglang head digests room=R heads=G:H,... aux=H rank=K`): servers of different TP
sizes hold different heads per page, and the same head must carry the same bytes on both.
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


def head_digests(held: Buffers, pages: np.ndarray, aux: int) -> tuple[dict[int, str], str]:
    """(sha256 per global KV head over every KV buffer's pages in order, sha256 of the aux rows); needs
    `held.heads`."""
    kv, aux_group = held.groups
    heads = held.heads
    per_head = [hashlib.sha256() for _ in range(heads.count)]
    for name in kv.layers:
        rows = held.tensors[name].numpy()[np.asarray(pages, dtype=np.int64)]
        rows = rows.reshape(len(rows), held.page_size, heads.count, -1)
        for i, h in enumerate(per_head):
            h.update(np.ascontiguousarray(rows[:, :, i]).tobytes())
    aux_hash = hashlib.sha256()
    for name in aux_group.layers:
        aux_hash.update(held.tensors[name].numpy()[aux].tobytes())
    return {heads.first + i: h.hexdigest() for i, h in enumerate(per_head)}, aux_hash.hexdigest()


def log_digest(held: Buffers, room: int, pages: np.ndarray, aux: int, rank: int = 0) -> None:
    """Log the room's digests on TP rank `rank` (only when enabled)."""
    if not enabled():
        return
    log.info("kvconnect sglang digest room=%d pages=%d sha256=%s rank=%d", room, len(pages),
             pages_digest(held, pages, aux), rank)
    if held.heads is not None:
        heads, aux_sha = head_digests(held, pages, aux)
        log.info("kvconnect sglang head digests room=%d heads=%s aux=%s rank=%d", room,
                 ",".join(f"{g}:{sha}" for g, sha in heads.items()), aux_sha, rank)
