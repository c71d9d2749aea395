"""Faults through real SGLang servers with kvconnect's backend: each request ends as SGLang expects (an
aborted request, never wrong tokens or a hang) and the surviving server keeps serving."""

import random
import re
import signal
import threading
import time

import pytest

from harness import PDSet, generate, http, prompts_of

pytestmark = pytest.mark.timeout(1800)

DELAY_S = 5.0  # the decode reads this long after the params arrive: the prefill dies in between
# SGLang's own heartbeat would also find the dead prefill and fail its requests; here it never gives up,
# so the only thing that can end the request is kvconnect's load failing.
ENV = {"KVCONNECT_SGLANG_FAULT_LOAD_DELAY_S": str(DELAY_S), "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1000000"}


@pytest.fixture(scope="module")
def slow_reader(model, logdir, reference):
    pair = PDSet(model, logdir, "kvconnect-mooncake", env=ENV, tag="faults-")
    yield pair
    pair.stop()


def _wait_for_line(path, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text(errors="replace"))
        if found:
            return found.group(0)
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} in {path} within {timeout} s")


def test_prefill_killed_before_decode_reads_aborts_the_request_with_a_typed_failure(slow_reader):
    pair = slow_reader
    ids = prompts_of([300], seed=3)[0]
    # The router's two requests, sent here so that the decode's outlives the prefill (the router would
    # drop it together with the prefill's connection, before kvconnect is asked to read anything).
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap, "bootstrap_room": random.randrange(2**63)}
    out: dict = {}
    decode = threading.Thread(target=lambda: out.update(generate(pair.decode_url, ids, extra=boot)))
    prefill = threading.Thread(target=lambda: generate(pair.prefill_url, ids, extra=boot), daemon=True)
    decode.start()
    prefill.start()
    # The decode got the params (the prefill computed and holds the pages): kill the prefill now.
    _wait_for_line(pair.decode.log, rf"fault injection: room {boot['bootstrap_room']} read in", 300)
    pair.prefill.kill(signal.SIGKILL)
    pair.prefill.proc.wait(timeout=30)
    decode.join(timeout=300)
    assert not decode.is_alive(), "the decode request did not end"
    assert "error" in out, f"a request whose prefill died before its pages were read returned tokens: {out}"
    # kvconnect's typed failure (the handshake or claim found nobody), not SGLang's heartbeat.
    reason = _wait_for_line(pair.decode.log, rf"room {boot['bootstrap_room']} failed: kvconnect: [^\n]*", 60)
    print(f"request: {out['error'][:200]}\ndecode: {reason[:300]}")
    assert http(f"{pair.decode_url}/health", timeout=30)[0] == 200
