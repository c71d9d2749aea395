"""kvconnect's metrics through vLLM's connector stats: increments stay increments, gauges stay current values.

Real kvconnect metrics move in this process; their stats are re-labelled as another process's, merged
the way vLLM merges workers and steps, and fed to the Prometheus hook vLLM calls in its API server.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import Counter, Gauge, Histogram, generate_latest

from kvconnect import metrics
from kvconnect.integrations.vllm.connectors import KVConnectNixl
from kvconnect.integrations.vllm.prom import KVConnectProm
from kvconnect.integrations.vllm.stats import AT, PROCESS_METRICS, KVConnectStats, source

ELSEWHERE = "engine-host:4242"


def _elsewhere(data: dict, src: str = ELSEWHERE) -> dict:
    """`data` as another process (`src`) would have reported it."""
    return {k.replace(f"{AT}{source()}", f"{AT}{src}"): v for k, v in data.items()}


@pytest.fixture()
def prom() -> KVConnectProm:
    PROCESS_METRICS.take()  # start from what this process has counted so far
    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    hook = KVConnectNixl.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                                            {0: ["m", "0"]})
    assert isinstance(hook, KVConnectProm)
    return hook


def test_a_gauge_over_many_steps_is_its_current_value_not_a_sum_of_steps(prom):
    held = metrics.value("kvconnect_leases_held")
    merged = KVConnectStats()
    for delta in (+1, +1, -1, +1, -1, -1, -1):  # ends one below where it started
        metrics.leases_held.inc(delta)
        merged.aggregate(KVConnectStats(data=PROCESS_METRICS.take()))
    assert merged.reduce()["kvconnect_leases_held"] == held - 1
    metrics.leases_held.inc(1)
    assert KVConnectStats(data=PROCESS_METRICS.take()).reduce()["kvconnect_leases_held"] == held


def test_counters_from_two_workers_and_two_steps_add_up(prom):
    merged = KVConnectStats()
    for src, n in (("w0:1", 100), ("w1:2", 40), ("w0:1", 5)):
        metrics.transfer_bytes.labels("nixl").inc(n)
        merged.aggregate(KVConnectStats(data=_elsewhere(PROCESS_METRICS.take(), src)))
    assert merged.reduce()["kvconnect_transfer_bytes_total{backend=nixl}"] == 145


def test_the_api_server_hook_adds_increments_and_sets_gauges(prom):
    key = ("kvconnect_transfer_bytes_total", {"backend": "mooncake"})
    metrics.transfer_bytes.labels("mooncake").inc(1000)
    metrics.failures.labels("transfer").inc()
    metrics.leases_held.inc(3)
    data = _elsewhere(PROCESS_METRICS.take())
    gauge = f"kvconnect_leases_held{AT}{ELSEWHERE}"
    assert data[gauge] == metrics.value("kvconnect_leases_held")  # the value, not the step's +3
    data[gauge] = 5.0  # what that process holds
    before = metrics.value(*key), metrics.value("kvconnect_failures_total", {"stage": "transfer"})
    prom.observe(data)
    assert metrics.value(*key) == before[0] + 1000
    assert metrics.value("kvconnect_failures_total", {"stage": "transfer"}) == before[1] + 1
    assert metrics.value("kvconnect_leases_held") == 5.0
    prom.observe({f"kvconnect_leases_held{AT}other:1": 2.0})  # a second engine process: sources add up
    assert metrics.value("kvconnect_leases_held") == 7.0
    prom.observe({f"kvconnect_leases_held{AT}{ELSEWHERE}": 0.0, f"kvconnect_leases_held{AT}other:1": 0.0})
    assert metrics.value("kvconnect_leases_held") == 0.0


def test_the_api_server_hook_rebuilds_histograms_bucket_by_bucket(prom):
    labels = {"backend": "mooncake"}
    names = [f"kvconnect_transfer_seconds_{s}" for s in ("count", "sum")]
    buckets = [{**labels, "le": le} for le in ("0.001", "0.01", "0.1", "+Inf")]
    start = [metrics.value(n, labels) for n in names] + [metrics.value("kvconnect_transfer_seconds_bucket", b)
                                                        for b in buckets]
    for s in (0.0002, 0.004, 0.05, 0.05, 70.0):
        metrics.transfer_seconds.labels("mooncake").observe(s)
    mid = [metrics.value(n, labels) for n in names] + [metrics.value("kvconnect_transfer_seconds_bucket", b)
                                                      for b in buckets]
    prom.observe(_elsewhere(PROCESS_METRICS.take()))
    end = [metrics.value(n, labels) for n in names] + [metrics.value("kvconnect_transfer_seconds_bucket", b)
                                                      for b in buckets]
    assert end == pytest.approx([m + (m - s) for s, m in zip(start, mid)])


def test_samples_of_this_process_and_malformed_ones_change_nothing(prom):
    metrics.offload_hits.inc(7)
    own = PROCESS_METRICS.take()
    exposed = _ours()
    prom.observe(own)  # counted live in this process already
    prom.observe({f"kvconnect_leases_held{{x=y}}{AT}a:1": 5, f"kvconnect_offload_hits_total{AT}a:1": float("nan"),
                  f"kvconnect_offload_hits{AT}a:1": 5, f"kvconnect_nothing_total{AT}a:1": 5,
                  f"kvconnect_offload_misses_total{AT}a:1": -4, f"kvconnect_offload_evictions_total{AT}a:1": "9",
                  "loads_ok": 3, f"kvconnect_transfer_seconds_bucket{{backend=nixl,le=x}}{AT}a:1": 1})
    assert _ours() == exposed


def _ours() -> list[str]:
    # Only kvconnect's lines: the registry's process and GC collectors move on their own between two reads.
    return [ln for ln in generate_latest().decode().splitlines() if "kvconnect_" in ln]


def test_the_exposition_has_each_metric_with_its_type():
    text = generate_latest().decode()
    for name, kind in metrics.KINDS.items():
        assert f"# TYPE {name}{'_total' if kind == 'counter' else ''} {kind}\n" in text, name
