"""The Mooncake Store tier across namespaces: the store on one side, the instances on the other.

The master and its storage node run in the prefill namespace; instance A (in the decode namespace)
stores 24 pages and exits; instance B, started afterwards in the decode namespace, loads them and
compares byte for byte. Every page crosses the veth twice (A to the storage node, the node to B),
which the veth's counters show. A and B share a namespace because a pair is what the suite creates;
what matters, that the store is remote to both, holds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netns import REPO, NetnsPair

INSTANCE = REPO / "tests" / "tier_instance.py"
PAGES = 24
PAGE_BYTES = 3 * 2 * 16 * 32 * 4  # tier_instance.py: three layers of [2, 16, 32] float32 per block


def _in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, *argv]


def _instance(pair: NetnsPair, mode: str, master: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(_in_ns(pair.decode, str(INSTANCE), mode, "--tier", f"store:{master}", "--blocks",
                                 str(PAGES), "--local-host", pair.decode_addr),
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_store_tier_pages_cross_namespaces_byte_exact(netns_pair: NetnsPair, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    store = subprocess.Popen(_in_ns(netns_pair.prefill, "-m", "kvconnect.offload.tiers.local_store",
                                    netns_pair.prefill_addr, str(tmp_path)),
                             stdout=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        line = store.stdout.readline().split()
        assert line[:1] == ["ready"], f"the store did not start: {line}"
        master = line[1]
        before = netns_pair.counters()
        a = _instance(netns_pair, "store", master)
        assert a["error"] is None and a["stats"]["tier_store_stored"] == PAGES, a
        b = _instance(netns_pair, "load", master)
        assert b["error"] is None and b["hits"] == b["loaded"] == PAGES and b["equal"], b
        moved = {k: v - before[k] for k, v in netns_pair.counters().items()}
        need = PAGES * PAGE_BYTES
        print(f"store tier across namespaces: veth bytes {moved}; page bytes {need} each way")
        assert moved["decode_tx"] >= need and moved["decode_rx"] >= need, moved
    finally:
        os.killpg(store.pid, signal.SIGTERM)
        try:
            store.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(store.pid, signal.SIGKILL)
            store.wait(10)
