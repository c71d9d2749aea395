"""The `kvconnect` command line: bad input ends in one line naming the flag and exit code 2, never a traceback."""

from __future__ import annotations

import json

import pytest

from kvconnect import __version__
from kvconnect.cli import EXIT_ENVIRONMENT, EXIT_OK, EXIT_USAGE, main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse exits from inside parse_args
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, named", [
    (["demo", "--concurrency", "0"], "--concurrency: must be at least 1"),
    (["demo", "--tokens", "0"], "--tokens: must be at least 1"),
    (["demo", "--preset", "foo"], "--preset: invalid choice: 'foo'"),
    (["bench", "transfer", "--preset", "foo"], "--preset: invalid choice: 'foo'"),
    (["bench", "transfer", "--sweep", "64,abc"], "--sweep: expected a positive integer, got 'abc'"),
    (["bench", "transfer", "--block-size", "-4"], "--block-size: must be at least 1"),
    (["bench", "descriptors", "--blocks", "0"], "--blocks: must be at least 1"),
    (["bench", "offload", "--preset", "foo"], "--preset: invalid choice: 'foo'"),
    (["bench", "offload", "--tokens", "4"], "--tokens must cover at least one full block of 16 tokens"),
    (["bench", "handshake", "--timeout", "nan"], "--timeout: must be a positive number"),
    (["bench", "isolation", "--rounds", "x"], "--rounds: expected a positive integer, got 'x'"),
    (["bench", "offload", "--tier", "disk", "--dir", "/nonexistent/xx"], "--dir: no such directory: '/nonexistent/xx'"),
    (["bench", "offload", "--tier", "disk", "--page-kib", "0"], "--page-kib: must be at least 1"),
    (["bench", "offload", "--page-kib", "64"], "--page-kib needs --tier"),
    (["bench", "offload", "--dir", "."], "--dir needs --tier"),
    (["bench", "offload", "--tier", "disk", "--master", "127.0.0.1:1"], "--master needs --tier store"),
    (["bench", "offload", "--tier", "disk", "--regions", "3"], "--page-kib: each page size must split into --regions 3"),
    (["demo", "--requests", "99999999999999999999"], "--requests: must be in 1..10000"),
    (["bench", "transfer", "--prefill-tp", "2"], "--prefill-tp needs --decode-tp"),
    (["bench", "transfer", "--decode-tp", "2"], "--decode-tp needs --prefill-tp"),
    (["bench", "transfer", "--prefill-tp", "2", "--decode-tp", "1", "--plot", "x.png"], "--plot sweeps a 1 -> 1 pull"),
    (["bench", "transfer", "--mode", "push"], "--mode push runs between TP sizes"),
    (["bench", "nosuch"], "unknown benchmark 'nosuch'"),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--port", "70000"], "--port: must be in 1..65535"),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--host", "0.0.0.0"], "0.0.0.0"),
    (["nosuch"], "invalid choice: 'nosuch'"),
])
def test_bad_input_is_one_line_naming_the_flag_and_exit_code_2(capsys, argv, named) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == EXIT_USAGE, (code, err)
    assert named in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 3, err  # argparse's usage line, then the error


def test_kvconnect_alone_prints_the_commands_and_exits_2(capsys) -> None:
    code, out, err = _run(capsys)
    assert code == EXIT_USAGE and not out and "required" not in err
    assert "usage: kvconnect" in err and all(name in err for name in ("demo", "doctor", "proxy", "bench NAME",
                                                                       "transfer", "isolation"))


@pytest.mark.parametrize("argv, slow_step, label", [
    (["demo"], "kvconnect.workload.pull.run_pull", "pulling ["),
    (["bench", "transfer"], "kvconnect.workload.pull.run_pull", "pulling ["),
    (["bench", "transfer", "--prefill-tp", "2", "--decode-tp", "1"], "kvconnect.workload.tp.run_tp_pull", "runs ["),
    (["bench", "isolation"], "kvconnect.bench.isolation._start", "producers, warm-up, rounds ["),
])
def test_long_commands_draw_their_progress_line_before_the_first_slow_step(capsys, monkeypatch, argv, slow_step,
                                                                            label) -> None:
    seen = []

    def slow(*args, **kwargs):
        seen.append(capsys.readouterr().err)
        raise KeyboardInterrupt  # what was drawn so far is all this test needs

    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    monkeypatch.setattr(slow_step, slow)
    assert _run(capsys, *argv)[0] == 130
    assert label in seen[0] and "] 0/" in seen[0], seen


def test_version_and_the_preset_list(capsys) -> None:
    assert _run(capsys, "--version")[:2] == (EXIT_OK, f"kvconnect {__version__}\n")
    code, out, _ = _run(capsys, "bench", "transfer", "-h")
    assert code == EXIT_OK and "hybrid-mamba" in out and "llama3-8b" in out


def test_a_missing_extra_exits_3_with_the_install_hint(capsys, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_uvicorn(name, *args, **kw):
        if name == "uvicorn":
            raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    code, _, err = _run(capsys, "proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2")
    assert code == EXIT_ENVIRONMENT and "pip install 'kvconnect[proxy]'" in err and "Traceback" not in err


def test_bench_handshake_prints_its_ratio_to_a_raw_zmq_round_trip(capsys) -> None:
    code, out, _ = _run(capsys, "bench", "handshake", "--count", "5", "--json")
    r = json.loads(out)
    assert code == EXIT_OK and r["p50_ms_raw_zmq"] > 0 and r["reply_bytes"] > 4096
    assert r["p50_ratio_vs_raw"] == pytest.approx(r["p50_ms"] / r["p50_ms_raw_zmq"], rel=1e-2)
