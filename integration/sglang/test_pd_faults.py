"""Faults through real SGLang servers with kvconnect's backend: each request ends as SGLang expects (an
aborted request, never wrong tokens or a hang) and the surviving server keeps serving."""

import os
import random
import re
import signal
import threading
import time

import pytest

from conftest import LENGTHS
from harness import PDSet, generate, generate_all, http, prompts_of

pytestmark = pytest.mark.timeout(1800)

DELAY_S = 5.0  # the decode reads this long after the params arrive: the prefill dies in between
# SGLang's own heartbeat would also find the dead prefill and fail its requests; here it never gives up,
# so the only thing that can end the request is kvconnect's load failing.
ENV = {"KVCONNECT_SGLANG_FAULT_LOAD_DELAY_S": str(DELAY_S), "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1000000"}
HOLD_S = 8.0  # every decode READ stays in flight this long, cancelled or not: an abort finds it still landing
HOLD_ENV = {"KVCONNECT_SGLANG_FAULT_READ_HOLD_S": str(HOLD_S), "KVCONNECT_SGLANG_PAGE_DIGESTS": "1"}


@pytest.fixture  # one test each: a pair stops before the next starts (two cores, little memory)
def slow_reader(model, logdir, reference):
    pair = PDSet(model, logdir, "kvconnect-mooncake", env=ENV, tag="faults-")
    yield pair
    pair.stop()


@pytest.fixture
def held_reads(model, logdir, reference):
    pair = PDSet(model, logdir, "kvconnect-mooncake", env=HOLD_ENV, tag="held-")
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


def _killed_before_read(pair, ids: list[int], kill) -> None:
    """Send a request to `pair`'s decode and prefill, call `kill` once the decode holds the params and
    waits to read, and check that the request then ends with kvconnect's typed failure and the decode
    stays healthy (the seconds from the kill to the request's end are printed)."""
    # The router's two requests, sent here so that the decode's outlives the prefill (the router would
    # drop it together with the prefill's connection, before kvconnect is asked to read anything).
    room = random.randrange(2**63)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap, "bootstrap_room": room}
    out: dict = {}
    decode = threading.Thread(target=lambda: out.update(generate(pair.decode_url, ids, extra=boot)))
    prefill = threading.Thread(target=lambda: generate(pair.prefill_url, ids, extra=boot), daemon=True)
    decode.start()
    prefill.start()
    _wait_for_line(pair.decode.log, rf"fault injection: room {room} read in", 300)
    kill()
    t0 = time.monotonic()
    decode.join(timeout=300)
    ended = time.monotonic() - t0
    assert not decode.is_alive(), "the decode request did not end"
    assert "error" in out, f"a request whose prefill died before its pages were read returned tokens: {out}"
    # kvconnect's typed failure (the handshake or claim found nobody), not SGLang's heartbeat.
    reason = _wait_for_line(pair.decode.log, rf"room {room} failed: kvconnect: [^\n]*", 60)
    print(f"ended {ended:.1f} s after the kill\nrequest: {out['error'][:200]}\ndecode: {reason[:300]}")
    assert http(f"{pair.decode_url}/health", timeout=30)[0] == 200


def test_prefill_killed_before_decode_reads_aborts_the_request_with_a_typed_failure(slow_reader):
    def kill() -> None:
        slow_reader.prefill.kill(signal.SIGKILL)
        slow_reader.prefill.proc.wait(timeout=30)

    _killed_before_read(slow_reader, prompts_of([300], seed=3)[0], kill)


def _rank_pid(server, title: str) -> int:
    """The pid of the process of `server`'s group whose title is `title` (an SGLang scheduler rank)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == server.proc.pid and \
                    open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")[0].decode() == title:
                return int(entry)
        except (OSError, UnicodeDecodeError):
            continue
    raise AssertionError(f"no process titled {title} in {server.name}'s group")


@pytest.fixture
def slow_reader_tp21(model, logdir, reference):
    pair = PDSet(model, logdir, "kvconnect-nixl", env=ENV, tag="faults-tp21-", tp=(2, 1))
    yield pair
    pair.stop()


def test_one_prefill_rank_killed_after_the_decode_gathered_fails_the_request_with_a_typed_failure(slow_reader_tp21):
    # A TP-1 decode reads each request from both ranks of a TP-2 prefill: with one of them gone, the
    # load must fail as a whole (half the heads are not a page), and the decode keeps serving.
    pair = slow_reader_tp21
    _killed_before_read(pair, prompts_of([300], seed=4)[0],
                        lambda: os.kill(_rank_pid(pair.prefill, "sglang::scheduler_TP1"), signal.SIGKILL))


def _digests(path) -> dict[str, str]:
    return dict(re.findall(r"kvconnect sglang digest room=(\d+) pages=\d+ sha256=(\w+)", path.read_text(errors="replace")))


def test_a_decode_abort_mid_read_frees_pages_only_after_kvconnect_reports_the_load_ended(held_reads, reference):
    pair = held_reads
    ids = prompts_of([300], seed=5)[0]
    room = random.randrange(2**63)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap, "bootstrap_room": room}
    rid = f"held-read-{room}"
    out: dict = {}
    decode = threading.Thread(target=lambda: out.update(generate(pair.decode_url, ids, extra={**boot, "rid": rid})))
    prefill = threading.Thread(target=lambda: generate(pair.prefill_url, ids, extra=boot), daemon=True)
    decode.start()
    prefill.start()
    # The READ is posted and cannot be recalled for HOLD_S: abort the request as a client cancel would.
    _wait_for_line(pair.decode.log, rf"fault injection: room {room} READ held", 300)
    _wait_for_line(pair.decode.log, r"fault injection: READ 1 posted", 60)  # the first READ of this server
    assert http(f"{pair.decode_url}/abort_request", {"rid": rid}, timeout=30)[0] == 200
    decode.join(timeout=300)
    assert not decode.is_alive(), "the aborted decode request did not end"
    assert "error" in out, f"an aborted request returned tokens: {out}"
    ended = _wait_for_line(pair.decode.log, rf"room {room} failed: kvconnect: [^\n]*", 120)
    freed = _wait_for_line(pair.decode.log, rf"room {room} pages released [^\n]*", 120)
    log = pair.decode.log.read_text(errors="replace")
    print(f"request: {out['error'][:200]}\nload: {ended[:200]}\npages: {freed}")
    assert "aborted by the engine" in ended, ended
    # SGLang held the pages until kvconnect reported that nothing more could land in them.
    assert log.index(ended) < log.index(freed), "the pages were freed before the load ended"
    assert "after its load ended" in freed, freed
    # The prefill's lease was released: its request ends rather than waiting out the lease.
    prefill.join(timeout=120)
    assert not prefill.is_alive(), "the prefill still holds the aborted request"
    # Requests after it get exactly the pages their prefill held, and a plain server's tokens.
    prompts = prompts_of(LENGTHS)
    before = set(_digests(pair.decode.log))
    got = generate_all(pair.url, prompts, concurrent=len(prompts))
    wrong = [(len(p), g) for p, g in zip(prompts, got) if g.get("ids") != reference[tuple(p)]["ids"]]
    assert not wrong, wrong
    held, loaded = _digests(pair.prefill.log), _digests(pair.decode.log)
    new = {r: sha for r, sha in loaded.items() if r not in before}
    assert len(new) >= len(prompts), f"decode logged {len(new)} loads for {len(prompts)} requests"
    differ = {r: (held.get(r), sha) for r, sha in new.items() if held.get(r) != sha}
    assert not differ, differ
    assert http(f"{pair.decode_url}/health", timeout=30)[0] == 200
