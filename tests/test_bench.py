"""The benchmarks run end to end in tiny configurations: valid JSON, verified bytes (no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _kvconnect(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvconnect.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_descriptors_reports_the_issue_keys() -> None:
    out = _kvconnect("bench", "descriptors", "--layers", "8", "--blocks", "256", "--repeat", "2", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["descriptors"] <= 8 * 256 and r["descriptors_contiguous"] == 8
    assert {"seconds_random", "seconds_contiguous", "python_loop_seconds"} <= r.keys()


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_bench_transfer_in_a_tiny_configuration_verifies_every_byte(backend) -> None:
    out = _kvconnect("bench", "transfer", "--backend", backend, "--preset", "mla", "--tokens", "48",
                     "--requests", "3", "--concurrency", "2", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["verified"] is True and r["failed"] == {}
    assert r["requests"] == 3 and r["bytes"] == 3 * r["bytes_per_request"] == 3 * 61 * 3 * 16 * 576 * 2
    for key in ("kvconnect_gbps", "raw_gbps", "raw_entries_gbps", "memcpy_gbps"):
        assert r[key] > 0
    assert r["ratio_vs_raw"] == pytest.approx(r["kvconnect_gbps"] / r["raw_gbps"])
    assert r["ratio_vs_raw_entries"] == pytest.approx(r["kvconnect_gbps"] / r["raw_entries_gbps"])
    assert r["held_blocks_after"] == 0


def test_bench_transfer_pushes_between_tp_sizes_beside_the_pull_and_verifies_every_byte() -> None:
    out = _kvconnect("bench", "transfer", "--preset", "llama3-70b-tp8", "--tokens", "64", "--requests", "2",
                     "--prefill-tp", "2", "--decode-tp", "1", "--mode", "push", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["verified"] is True and r["failed"] == 0 and r["mode"] == "push"
    assert r["push_gbps"] > 0 and r["gbps"] > 0 and r["one_to_one_gbps"] > 0
    assert r["push_ratio_vs_pull"] == pytest.approx(r["push_gbps"] / r["gbps"])


def test_bench_transfer_draws_its_plot(tmp_path) -> None:
    png = tmp_path / "transfer.png"
    out = _kvconnect("bench", "transfer", "--preset", "llama3-70b-tp8", "--requests", "1", "--concurrency", "1",
                     "--plot", str(png), "--sweep", "16,64", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["tokens"] for r in results] == [16, 64] and all(r["verified"] for r in results)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_json_has_the_documented_keys() -> None:
    out = _kvconnect("demo", "--preset", "hybrid", "--tokens", "40", "--requests", "2", "--concurrency", "2",
                     "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("backend", "requests", "bytes", "seconds", "gbps", "p50_ms", "p99_ms", "verified"):
        assert key in r
    assert r["verified"] is True and r["backend"] == "nixl"


def test_bench_isolation_measures_healthy_loads_beside_a_stopped_producer() -> None:
    out = _kvconnect("bench", "isolation", "--loads", "3", "--rounds", "2", "--blocks", "2", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("alone_p50_ms", "alone_p99_ms", "beside_stopped_p50_ms", "beside_stopped_p99_ms", "p50_ratio"):
        assert r[key] > 0, key
