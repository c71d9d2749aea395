"""The P/D conformance suite with producer and consumer in two network namespaces, per backend.

Each backend's share of tests/test_pd_conformance.py (`-k BACKEND`, the cross-backend handshake case
included) runs as an inner pytest inside the decode namespace; its producers are launched into the
prefill namespace. Sides bind their own namespace's address, the side channel is authenticated with
a fresh secret, and NIXL is held to UCX's tcp transport on `kc0`: left to itself UCX would use
shared memory and cross-memory attach between the namespaces (they share one kernel and one PID
namespace) and no byte would cross the veth. The veth's byte counters then prove that the pulled
bytes did cross it.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from netns import REPO, NetnsPair
from pd_peer import make_caches

SUITE = "tests/test_pd_conformance.py"
INNER_TIMEOUT_S = 1500.0  # the whole inner suite of one backend; each inner test has its own 300 s limit


def block_bytes(kind: str) -> int:
    """Bytes one block id moves across every region of a conformance cache kind."""
    caches, _ = make_caches(kind, 1, 0)
    return sum(t.nbytes for t in caches.values())


def pulled_kv_bytes() -> int:
    """KV bytes that the conformance suite's successful pulls move for one backend.

    A lower bound on what the veth carries from prefill to decode: headers, handshakes and control
    messages only add to it, and the pull that the kill test cuts short is not counted. It follows
    the suite's tests: 3 requests of 9 block ids for each cache kind (a hybrid request moves 9 ids
    in each of its two groups, which `block_bytes` counts as 9 ids of all four layers), and dense
    pulls of 2 (prefix suffix), 256 (32 concurrent requests of 8), 2 (slow pull kept alive) and
    1 + 2 (restarted producer) blocks. If the suite moves fewer bytes, update this sum with it.
    """
    random_tables = 3 * 9 * sum(block_bytes(k) for k in ("dense", "mla", "hybrid", "cross"))
    return random_tables + (2 + 256 + 2 + 3) * block_bytes("dense")


def inner_env(pair: NetnsPair, backend: str) -> dict[str, str]:
    """Environment of the inner pytest: producer in prefill, consumer in decode, secret, UCX on the veth."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCONNECT_TEST_", "UCX_"))}
    env.update({
        "KVCONNECT_TEST_PRODUCER_LAUNCH": f"ip netns exec {pair.prefill}",
        "KVCONNECT_TEST_PRODUCER_PYTHON": sys.executable,
        "KVCONNECT_TEST_PRODUCER_HOST": pair.prefill_addr,
        "KVCONNECT_TEST_CONSUMER_HOST": pair.decode_addr,
        "KVCONNECT_SECRET": secrets.token_hex(32),
        # tcp alone: adding `sm` or `cma` lets UCX copy through shared memory past the veth (measured:
        # a few KiB on the veth for a 64 MiB pull); `tcp,self` works too but adds nothing here.
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": pair.device,
        "PYTHONUNBUFFERED": "1",
    })
    return env


def collected(backend: str, env: dict[str, str]) -> list[str]:
    """Test names the inner run must report, from pytest's own collection of the same selection."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", SUITE,
                          "-k", backend], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"collecting {SUITE} -k {backend} failed:\n{res.stdout}\n{res.stderr}"
    names = [line.split("::", 1)[1] for line in res.stdout.splitlines() if line.startswith(SUITE + "::")]
    assert names, f"nothing collected for -k {backend}:\n{res.stdout}"
    return names


def junit_outcomes(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """The totals of a junit report and each test case's outcome (passed, failed, error, skipped)."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    totals = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    outcomes = {}
    for case in suite.iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return totals, outcomes


def tail(path: Path, lines: int = 60) -> str:
    """The last lines of a log, for assertion messages."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.mark.timeout(INNER_TIMEOUT_S + 400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_conformance_suite_passes_between_namespaces(backend: str, netns_pair: NetnsPair, tmp_path: Path) -> None:
    env = inner_env(netns_pair, backend)
    expected = collected(backend, env)
    report, log = tmp_path / f"{backend}.xml", tmp_path / f"{backend}.log"
    before = netns_pair.counters()
    with log.open("w") as out:
        try:
            rc = subprocess.run(
                ["ip", "netns", "exec", netns_pair.decode, sys.executable, "-m", "pytest", "-q", "-p",
                 "no:cacheprovider", f"--junitxml={report}", SUITE, "-k", backend],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=INNER_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            pytest.fail(f"inner suite ({backend}) ran past {INNER_TIMEOUT_S} s:\n{tail(log)}")
    after = netns_pair.counters()
    assert rc == 0, f"inner suite ({backend}) exited {rc}:\n{tail(log)}"
    totals, outcomes = junit_outcomes(report)
    not_passed = {name: o for name, o in outcomes.items() if o != "passed"}
    assert not not_passed and totals["failures"] == totals["errors"] == totals["skipped"] == 0, \
        f"inner suite ({backend}): {totals}, not passed: {not_passed}\n{tail(log)}"
    assert sorted(outcomes) == sorted(expected), \
        f"inner suite ({backend}) reported {sorted(outcomes)}, collection has {sorted(expected)}"
    moved = {k: after[k] - before[k] for k in after}
    need = pulled_kv_bytes()
    print(f"{backend}: {len(outcomes)} passed; veth bytes {moved}; KV bytes pulled at least {need}")
    # Blocks flow from prefill to decode: out of prefill's kc0, into decode's.
    assert moved["decode_rx"] >= need and moved["prefill_tx"] >= need, \
        f"{backend}: the veth carried {moved}, less than the {need} KV bytes the suite pulls"
