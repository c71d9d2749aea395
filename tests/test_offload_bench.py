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
