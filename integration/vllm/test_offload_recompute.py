"""KVConnectOffload's recompute-time estimate, through the real halves without an engine: the scheduler
times steps from vLLM's scheduled-token count and hands its rate to the worker in the metadata, the
worker credits each load `tokens x rate - seconds the load took` (TP rank 0 only), the scheduler's stats
file sums the credits, and the Prometheus hook feeds the two counters. A stepping clock stands in for
wall time; the copies are real.
"""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from kvconnect import metrics
from harness import wait_for
from kvconnect.integrations.vllm.config import DiskTierConfig, OffloadConfig
from kvconnect.integrations.vllm.meta import KVConnectMeta, OffloadLoad, OffloadStore
from kvconnect.integrations.vllm.offload_scheduler import OffloadScheduler
from kvconnect.integrations.vllm.offload_worker import OffloadWorker
from kvconnect.integrations.vllm.prom import KVConnectProm
from kvconnect.integrations.vllm.stats import KVConnectStats
from kvconnect.offload.recompute import ComputeRate

BLOCKS, PAGE = 8, 256


class _Clock:
    """Each read moves time on by `tick` seconds: a load's two reads measure exactly `tick`."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick = 10.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _worker(rank: int = 0, tp: int = 1, tick: float = 0.004) -> OffloadWorker:
    caches = {f"layer{i}": torch.zeros((BLOCKS, PAGE), dtype=torch.uint8) for i in range(2)}
    worker = OffloadWorker(num_slots=4, slot_bytes=2 * PAGE, timeout_s=5.0, connector="KVConnectOffload",
                           rank=rank, tp=tp, clock=_Clock(tick))
    worker.register_kv_caches(caches)
    return worker


def _load(**kw) -> KVConnectMeta:
    rate = kw.pop("rate", 0.0)
    return KVConnectMeta(offload_loads=[OffloadLoad(block_ids=[5, 6], slots=[0, 1], tokens=32, **kw)],
                         seconds_per_token=rate)


def test_a_load_is_credited_its_tokens_at_the_engines_rate_less_the_time_it_took() -> None:
    worker = _worker(tick=0.004)
    try:
        worker.start(_load(rate=0.001))
        data = worker.stats().data
        assert data["blocks_loaded"] == 2
        assert data["load_seconds"] == pytest.approx(0.004)
        assert data["load_recompute_seconds_est"] == pytest.approx(32 * 0.001)
        assert data["load_saved_seconds_est"] == pytest.approx(32 * 0.001 - 0.004)
    finally:
        worker.shutdown()


def test_a_load_slower_than_recomputing_is_reported_as_a_negative_saving() -> None:
    worker = _worker(tick=0.5)
    try:
        worker.start(_load(rate=0.001))
        assert worker.stats().data["load_saved_seconds_est"] == pytest.approx(32 * 0.001 - 0.5)
    finally:
        worker.shutdown()


def test_a_load_with_a_block_vllm_recomputes_saves_no_tokens() -> None:
    worker = _worker(tick=0.004)
    try:
        worker.start(_load(rate=0.001, invalid_block_ids=[7]))
        data = worker.stats().data
        assert "load_recompute_seconds_est" not in data  # zero: dropped like every zero count
        assert data["load_saved_seconds_est"] == pytest.approx(-0.004)
    finally:
        worker.shutdown()


def test_a_load_before_the_engine_has_a_rate_is_estimated_once_a_step_brings_one() -> None:
    worker = _worker(tick=0.004)
    try:
        worker.start(_load())
        data = worker.stats().data
        assert data["load_seconds"] == pytest.approx(0.004)
        assert "load_saved_seconds_est" not in data
        worker.start(KVConnectMeta(seconds_per_token=0.002))  # a later step brings the rate
        assert worker.stats().data == pytest.approx({"load_recompute_seconds_est": 32 * 0.002,
                                                     "load_saved_seconds_est": 32 * 0.002 - 0.004})
        worker.start(_load())  # a step's meta without a rate keeps the last one
        assert worker.stats().data["load_saved_seconds_est"] == pytest.approx(32 * 0.002 - 0.004)
    finally:
        worker.shutdown()


def test_a_load_from_the_disk_tier_is_credited_when_it_is_reported_done(tmp_path) -> None:
    gen = torch.Generator().manual_seed(7)
    caches = {f"layer{i}": torch.randint(0, 256, (BLOCKS, PAGE), dtype=torch.uint8, generator=gen) for i in range(2)}
    stored = caches["layer1"][1:3].clone()
    worker = OffloadWorker(num_slots=4, slot_bytes=2 * PAGE, timeout_s=5.0, connector="KVConnectOffload",
                           tiers=[DiskTierConfig(path=str(tmp_path / "disk"))], clock=_Clock(0.03))
    worker.register_kv_caches(caches)
    try:
        keys = [b"k" * 16, b"j" * 16]
        worker.after_forward(KVConnectMeta(offload_stores=[OffloadStore(request_id="s", block_ids=[1, 2], slots=[0, 1],
                                                                        keys=keys)]))
        wait_for(lambda: (m := worker.worker_meta()) and ("s", 0) in m.written_down, 10, "the write-down")
        worker.start(KVConnectMeta(seconds_per_token=0.001, offload_loads=[OffloadLoad(
            block_ids=[5, 6], slots=[2, 3], request_id="r", fetch_keys=keys, tokens=32)]))
        wait_for(lambda: "r" in worker.finished_recving(), 10, "the load to be reported")
        assert not worker.invalid_blocks()
        assert torch.equal(caches["layer1"][5:7], stored)
        data = worker.stats().data
        assert data["load_seconds"] == pytest.approx(0.03)  # submitted to done: one clock tick
        assert data["load_saved_seconds_est"] == pytest.approx(32 * 0.001 - 0.03)
    finally:
        worker.shutdown()


def test_only_tp_rank_0_reports_load_timings() -> None:
    worker = _worker(rank=1, tp=2)
    try:
        worker.start(_load(rate=0.001))
        assert set(worker.stats().data) == {"blocks_loaded"}
    finally:
        worker.shutdown()


def _scheduler(tmp_path, clock: _Clock) -> OffloadScheduler:
    sched = OffloadScheduler(OffloadConfig(cpu_bytes=1 << 20, stats_path=str(tmp_path / "stats.json")),
                             block_size=16, num_slots=8, slot_bytes=1024)
    sched.rate = ComputeRate(clock, decay=1.0)
    return sched


def _step(sched: OffloadScheduler, clock: _Clock, tokens: int, seconds: float, worker: dict | None = None):
    meta = sched.build_meta(SimpleNamespace(total_num_scheduled_tokens=tokens))
    clock.now += seconds
    sched.update_connector_output(SimpleNamespace(finished_recving=None, finished_sending=None,
                                                  kv_connector_worker_meta=None,
                                                  kv_connector_stats=KVConnectStats(data=worker or {})))
    return meta


def test_the_scheduler_times_steps_hands_the_rate_on_and_files_the_workers_credits(tmp_path) -> None:
    clock = _Clock()
    sched = _scheduler(tmp_path, clock)
    assert _step(sched, clock, 100, 0.2).seconds_per_token == 0.0  # nothing measured before this step
    assert _step(sched, clock, 300, 0.2).seconds_per_token == pytest.approx(0.2 / 100)
    credits = {"load_seconds": 0.01, "load_recompute_seconds_est": 0.5, "load_saved_seconds_est": 0.49}
    _step(sched, clock, 0, 0.0, credits)
    _step(sched, clock, 0, 0.0, {**credits, "load_saved_seconds_est": -0.3, "load_recompute_seconds_est": 0.0})
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["load_seconds"] == pytest.approx(0.02)
    assert stats["load_recompute_seconds_est"] == pytest.approx(0.5)
    assert stats["load_saved_seconds_est"] == pytest.approx(0.19)
    assert stats["seconds_per_token_est"] == pytest.approx(0.4 / 400)


def test_a_step_without_vllms_output_or_with_copies_is_not_timed(tmp_path) -> None:
    clock = _Clock()
    sched = _scheduler(tmp_path, clock)
    sched.build_meta()
    clock.now += 5.0
    sched.update_connector_output(SimpleNamespace(finished_recving=None, finished_sending=None,
                                                  kv_connector_worker_meta=None))
    sched._meta.offload_loads.append(OffloadLoad(block_ids=[1], slots=[0], tokens=16))
    _step(sched, clock, 100, 5.0)
    assert sched.rate.seconds_per_token == 0.0


def test_the_prometheus_hook_adds_the_workers_load_timings_to_the_two_counters() -> None:
    prom = KVConnectProm(SimpleNamespace(kv_transfer_config=None), defaultdict(lambda: None), [], {})
    names = ("kvconnect_offload_load_seconds_total", "kvconnect_offload_recompute_est_seconds_total")
    before = [metrics.value(n) for n in names]
    prom.observe({"load_seconds": 0.25, "load_recompute_seconds_est": 1.5, "load_saved_seconds_est": 1.25,
                  "blocks_loaded": 3})
    prom.observe({"load_seconds": 0.5, "load_saved_seconds_est": -0.5})
    assert [metrics.value(n) - b for n, b in zip(names, before)] == pytest.approx([0.75, 1.5])
