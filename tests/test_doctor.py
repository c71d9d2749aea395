"""`kvconnect doctor` tells a working backend from a missing one, by a real round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _doctor(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "kvconnect.cli", "doctor", "--json", *args],
                         capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1])


def test_doctor_reports_a_backend_made_unavailable_and_exits_non_zero_for_it(tmp_path) -> None:
    shadow = tmp_path / "mooncake"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('mooncake hidden by the test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code, report = _doctor("--backend", "mooncake", env=env)
    assert code == 1 and report["backend_ok"] is False
    moon = report["backends"]["mooncake"]
    assert moon["ok"] is False and "mooncake hidden by the test" in moon["error"] and "libibverbs" in moon["hint"]
    assert report["backends"]["nixl"]["ok"] is True, report["backends"]["nixl"]  # a real round trip

    code, report = _doctor("--backend", "nixl", env=env)
    assert code == 0 and report["backend_ok"] is True, report["backends"]["nixl"]


def test_doctor_fails_a_side_channel_address_this_host_does_not_have() -> None:
    env = {"KVCONNECT_SECRET": ""}
    code, report = _doctor("--host", "192.0.2.77", env=env)  # TEST-NET-1: never assigned to a real host
    sc = report["side_channel"]
    assert code == 1 and report["backend_ok"] is True and sc["bindable"] is False
    assert "not an address of this host" in sc["hint"] and "KVCONNECT_SECRET" in sc["hint"]
    assert sc["secret_set"] is False and not sc["loopback"]
    assert report["cuda"]["available"] in (True, False)
    assert "UCX_MODULES" in report["ucx"]
