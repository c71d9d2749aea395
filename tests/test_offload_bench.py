"""`kvconnect bench offload` at a toy size: it runs, verifies the bytes and reports the promised keys."""

from __future__ import annotations

import argparse
import json

import pytest

from kvconnect.bench import offload
from kvconnect.cliargs import UsageError


def _run(capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    offload.add_arguments(parser)
    code = offload.run(parser.parse_args(list(argv)))
    return code, capsys.readouterr().out


@pytest.mark.parametrize("preset", ["llama3-8b", "hybrid"])
def test_bench_json_reports_throughput_beside_memcpy_and_verifies(capsys, preset) -> None:
    code, out = _run(capsys, "--json", "--preset", preset, "--tokens", "40", "--requests", "2", "--repeat", "2")
    result = json.loads(out)
    assert code == 0 and result["verified"] is True
    for key in ("store_gbps", "load_gbps", "memcpy_gbps", "store_ratio", "load_ratio"):
        assert result[key] > 0
    assert result["blocks"] == 2 * (40 // 16)
    assert result["evictions"] == result["blocks"]  # the second pass replaced the first


def test_bench_table_and_bad_arguments(capsys) -> None:
    code, out = _run(capsys, "--tokens", "16", "--requests", "1", "--repeat", "1", "--policy", "arc")
    assert code == 0 and "vs memcpy" in out and "match the stored blocks" in out
    with pytest.raises(SystemExit):  # argparse: invalid choice (tests/test_cli.py checks the message)
        _run(capsys, "--preset", "nope")
    with pytest.raises(UsageError, match="full block"):
        _run(capsys, "--tokens", "3")


def _run_tier(capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    offload.add_arguments(parser)
    args = parser.parse_args(list(argv))
    offload.check_arguments(args)  # fills in the tier defaults, as the command line does
    return offload.run(args), capsys.readouterr().out


@pytest.mark.parametrize("tier", ["disk", "store"])
def test_tier_bench_reports_each_size_beside_its_raw_baseline_and_the_target(capsys, tmp_path, tier) -> None:
    code, out = _run_tier(capsys, "--tier", tier, "--json", "--page-kib", "64,256", "--pages", "4", "--repeat", "1",
                     "--dir", str(tmp_path))
    result = json.loads(out)
    assert code == 0 and result["verified"] is True and result["target_ratio"] == 0.9
    assert [s["page_kib"] for s in result["sizes"]] == [64, 256]
    for size in result["sizes"]:
        assert size["verified"] and size["rejected"] == 0
        assert size["store_ratio"] == pytest.approx(size["store_gbps"] / size["raw_store_gbps"])
        assert size["load_ratio"] == pytest.approx(size["load_gbps"] / size["raw_load_gbps"])
        assert size["meets_target"] == (min(size["store_ratio"], size["load_ratio"]) >= 0.9)
        for op, ours, raw in (("store", "store_gbps", "raw_store_gbps"), ("load", "load_gbps", "raw_load_gbps")):
            # Seconds add: the raw operation's and one checksum pass's, over the tier's.
            seconds = 1 / size[raw] + 1 / size["check_gbps"]
            assert size[f"{op}_ratio_vs_raw_and_check"] == pytest.approx(seconds * size[ours])
    code, out = _run_tier(capsys, "--tier", tier, "--page-kib", "64", "--pages", "2", "--repeat", "1", "--dir", str(tmp_path))
    assert code == 0 and "target: store and load >= 0.9 x raw" in out and "match the stored pages" in out
    assert "+check: the same against the raw operation followed by one checksum pass" in out
