"""Prometheus metrics move with what happens: a transfer, a failure, a lease, an eviction."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import torch

from kvconnect import metrics
from kvconnect.connector import ConnectorConfig, KVConnector
from kvconnect.offload import OffloadConnector

from conftest import free_port



def _wait(conn: KVConnector, rid: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fin = conn.get_finished()
        if rid in fin.loaded or rid in fin.failed:
            return fin
        time.sleep(0.002)
    raise AssertionError(f"{rid} never finished")


def test_a_pull_a_failure_and_a_lease_show_in_the_metrics() -> None:
    caches = {f"l{i}": torch.randint(0, 100, (16, 2, 16, 64), dtype=torch.int16) for i in range(2)}
    local = {f"l{i}": torch.zeros(16, 2, 16, 64, dtype=torch.int16) for i in range(2)}
    prefill = KVConnector(ConnectorConfig(role="producer", engine_id="m-prefill"))
    decode = KVConnector(ConnectorConfig(role="consumer", engine_id="m-decode", handshake_timeout_s=1.0))
    try:
        prefill.register_kv_caches(caches)
        decode.register_kv_caches(local)
        before = {k: metrics.value(k, {"backend": "nixl"}) for k in
                  ("kvconnect_transfer_bytes_total", "kvconnect_transfer_seconds_count",
                   "kvconnect_transfer_descriptors_count")}
        held = metrics.value("kvconnect_leases_held")
        done = metrics.value("kvconnect_leases_released_total", {"reason": "done"})
        hs = metrics.value("kvconnect_handshake_seconds_count")

        params = prefill.request_finished("m-1", [[3, 4, 5]], num_tokens=48)
        assert metrics.value("kvconnect_leases_held") == held + 1
        decode.start_load(params, [[0, 1, 2]])
        assert not _wait(decode, "m-1").failed
        assert torch.equal(local["l1"][:3], caches["l1"][3:6])
        block = 2 * 16 * 64 * 2
        assert metrics.value("kvconnect_transfer_bytes_total", {"backend": "nixl"}) == \
            before["kvconnect_transfer_bytes_total"] + 3 * 2 * block
        assert metrics.value("kvconnect_transfer_seconds_count", {"backend": "nixl"}) == \
            before["kvconnect_transfer_seconds_count"] + 1
        assert metrics.value("kvconnect_transfer_descriptors_count", {"backend": "nixl"}) == \
            before["kvconnect_transfer_descriptors_count"] + 1
        assert metrics.value("kvconnect_handshake_seconds_count") == hs + 1
        deadline = time.monotonic() + 10
        while prefill.held_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metrics.value("kvconnect_leases_held") == held
        assert metrics.value("kvconnect_leases_released_total", {"reason": "done"}) == done + 1

        failed = metrics.value("kvconnect_failures_total", {"stage": "handshake"})
        bad = {"engine_id": "nobody", "host": "127.0.0.1", "port": free_port(), "request_id": "m-2",
               "block_ids": [[1]], "num_tokens": 16, "lease_expiry": time.time() + 30, "incarnation": "x"}
        decode.start_load(bad, [[7]])
        assert "m-2" in _wait(decode, "m-2").failed
        assert metrics.value("kvconnect_failures_total", {"stage": "handshake"}) == failed + 1
    finally:
        decode.close()
        prefill.close()


def test_evictions_and_hits_in_the_cpu_tier_show_in_the_metrics() -> None:
    caches = {"l0": torch.randint(0, 100, (8, 64), dtype=torch.int32)}
    tier = OffloadConnector(cpu_bytes=2 * 64 * 4)  # two slots
    try:
        tier.register_kv_caches(caches)
        ev, hits, misses = (metrics.value(f"kvconnect_offload_{n}_total") for n in ("evictions", "hits", "misses"))
        keys = tier.block_keys(np.arange(16 * 3))
        tier.wait(tier.store(keys, [0, 1, 2]), timeout=10)  # three blocks into two slots
        assert tier.lookup(keys[:1]) == 1
        assert tier.lookup([b"unknown-key"]) == 0
        assert metrics.value("kvconnect_offload_hits_total") == hits + 1
        assert metrics.value("kvconnect_offload_misses_total") == misses + 1
        tier.wait(tier.store(tier.block_keys(np.arange(100, 132)), [3, 4]), timeout=10)
        assert metrics.value("kvconnect_offload_evictions_total") > ev
    finally:
        tier.close()


def test_metrics_can_be_served_over_http_for_standalone_workers() -> None:
    port = free_port()
    metrics.serve(port)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "kvconnect_leases_held" in body and "kvconnect_failures_total" in body


def test_every_snapshot_key_parses_back_to_its_metric_and_labels() -> None:
    metrics.transfer_seconds.labels("nixl").observe(0.01)
    metrics.tier_pages.labels("disk", "stored").inc(0)
    snap = metrics.snapshot()
    assert snap
    for key in snap:
        metric, suffix, labels = metrics.parse_sample(key)
        name = key.split("{", 1)[0]
        assert name == metric.describe()[0].name + suffix, key
        assert set(labels) - {"le"} == set(metric._labelnames), key


def test_keys_that_name_no_sample_of_ours_do_not_parse() -> None:
    for key in ("kvconnect_nothing_total", "kvconnect_transfer_bytes_total", "kvconnect_transfer_bytes",
                "kvconnect_leases_held{x=y}", "kvconnect_leases_held_total", "kvconnect_transfer_bytes_total{backend}",
                "kvconnect_transfer_seconds_bucket{backend=nixl}", "kvconnect_failures_total{stage=a,stage2=b}",
                "process_cpu_seconds_total", "kvconnect_transfer_bytes_total{backend=nixl}x"):
        assert metrics.parse_sample(key) is None, key


def test_per_group_offload_hits_keep_vllms_group_index_through_a_snapshot() -> None:
    # Under vLLM these samples ride in the connector stats as snapshot keys and are parsed back in the API server.
    for metric in (metrics.offload_group_hits, metrics.offload_group_tier_hits):
        assert "index in vLLM's KV-cache config" in metric.describe()[0].documentation
        metric.labels("3").inc(5)
        name = metric.describe()[0].name + "_total"
        assert metrics.parse_sample(f"{name}{{group=3}}") == (metric, "_total", {"group": "3"})
        assert metrics.snapshot()[f"{name}{{group=3}}"] == metrics.value(name, {"group": "3"}) >= 5
        assert metrics.parse_sample(f"{name}") is None  # a group counter's sample always names its group
