"""An asynchronous offload load that fails anywhere reports every block it did not fill as invalid.

vLLM decodes on the blocks a load reports done, so a load whose lower tier raised, or whose copy into
the engine's blocks failed, must name those blocks in `get_block_ids_with_load_errors`: vLLM then
recomputes them. On a model of several KV-cache groups vLLM takes no block errors (it stops): there such
a load fails its request (`failed_recving`) and names no block. Runs the real worker half, real host
pool and real copies; only the failure is made.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvconnect.errors import TransferError
from kvconnect.integrations.vllm.meta import KVConnectMeta, OffloadLoad
from kvconnect.integrations.vllm.offload_worker import OffloadWorker
from kvconnect.offload.jobs import JobRunner

BLOCKS, PAGE = 8, 256


class _Chain:
    """A lower-tier chain that finds every page (`finds`) or raises, as a broken tier would."""

    def __init__(self, raises: bool):
        self.raises = raises

    def fetch(self, keys, slots) -> np.ndarray:
        if self.raises:
            raise OSError("the disk under the tier went away")
        return np.ones(len(keys), dtype=bool)

    def close(self, timeout: float) -> None:
        return


def _worker(chain: _Chain) -> OffloadWorker:
    caches = {f"layer{i}": torch.zeros((BLOCKS, PAGE), dtype=torch.uint8) for i in range(2)}
    worker = OffloadWorker(num_slots=4, slot_bytes=2 * PAGE, timeout_s=5.0, connector="KVConnectOffload")
    worker.register_kv_caches(caches)
    worker._chain, worker._fetcher = chain, JobRunner(1, name="test-fetch")
    return worker


def _ended(worker: OffloadWorker, rid: str) -> tuple[set[str], set[int]]:
    """(failed_recving, invalid blocks) of the step whose finished_recving first names `rid`."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if rid in worker.finished_recving():
            return worker.failed_recving(), worker.invalid_blocks()
        time.sleep(0.01)
    raise AssertionError(f"load {rid} never reported")


@pytest.mark.parametrize("where", ["tier raises", "copy fails"])
def test_a_failed_fetch_reports_every_block_it_did_not_fill_as_invalid(where, monkeypatch) -> None:
    worker = _worker(_Chain(raises=where == "tier raises"))
    if where == "copy fails":
        def fail(*args, **kwargs):
            raise TransferError("copy into the engine's blocks failed")
        monkeypatch.setattr(worker._mover, "load", fail)
    load = OffloadLoad(block_ids=[5, 6, 7], slots=[0, 1, 2], request_id="r", fetch_keys=[b"a", b"b"], fetch_from=1)
    worker.start(KVConnectMeta(offload_loads=[load]))
    try:
        assert _ended(worker, "r") == (set(), {5, 6, 7})
    finally:
        worker.shutdown()


def test_a_fetch_that_filled_every_block_reports_none_invalid() -> None:
    worker = _worker(_Chain(raises=False))
    load = OffloadLoad(block_ids=[5, 6], slots=[0, 1], request_id="ok", fetch_keys=[b"a"], fetch_from=1)
    worker.start(KVConnectMeta(offload_loads=[load]))
    try:
        assert _ended(worker, "ok") == (set(), set())
    finally:
        worker.shutdown()


# ---- several KV-cache groups: vLLM takes no block errors there, so a failed load fails its request ----

@pytest.mark.parametrize("where", ["tier raises", "copy fails", "no page for a block", "host pool copy fails"])
def test_a_several_group_load_that_cannot_fill_every_block_fails_its_request_and_names_no_block(
        where, monkeypatch) -> None:
    worker = _worker(_Chain(raises=where == "tier raises"))
    if where in ("copy fails", "host pool copy fails"):
        def fail(*args, **kwargs):
            raise TransferError("copy into the engine's blocks failed")
        monkeypatch.setattr(worker._mover, "load", fail)
    if where == "host pool copy fails":  # nothing from below: the copy runs on the engine's thread
        load = OffloadLoad(block_ids=[5, 6], slots=[0, 1], request_id="r", fetch_from=2, fail_request=True)
    else:
        load = OffloadLoad(block_ids=[5, 6, 7], slots=[0, 1, 2], request_id="r", fetch_keys=[b"a", b"b"], fetch_from=1,
                           invalid_block_ids=[9] if where == "no page for a block" else [], fail_request=True)
    worker.start(KVConnectMeta(offload_loads=[load]))
    try:
        assert _ended(worker, "r") == ({"r"}, set())
    finally:
        worker.shutdown()


def test_a_several_group_load_from_the_host_pool_alone_lands_its_bytes_and_fails_nothing() -> None:
    worker = _worker(_Chain(raises=False))
    for k, pool in enumerate(worker._mover.pool):
        pool[0].fill_(7 + k)  # slot 0, region by region
    load = OffloadLoad(block_ids=[5], slots=[0], request_id="h", fetch_from=1, fail_request=True)
    worker.start(KVConnectMeta(offload_loads=[load]))
    try:
        assert _ended(worker, "h") == (set(), set())
        for k, rows in enumerate(worker._mover.rows):
            assert bool((rows[5] == 7 + k).all()) and not bool(rows[4].any())
    finally:
        worker.shutdown()
