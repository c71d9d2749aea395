"""kvconnect as SGLang's transfer backend with tensor parallelism: a TP-2 prefill and a TP-2 decode.

Each TP rank registers its own KV heads and each decode rank reads the prefill rank of its index.
Greedy tokens and logprobs equal a plain TP-2 server's, every rank's pages on decode equal that
rank's on prefill byte for byte, and a decode of another TP size is refused: its request ends
aborted within SGLang's bounded retries, nothing is read, and the decode keeps serving.
"""

import random
import re
import time

import pytest

from harness import PDSet, generate, generate_all, plain_outputs, prompts_of, sglang
from test_pd_e2e import _compare

pytestmark = pytest.mark.timeout(2400)

# Each TP rank on a core of its own (SGLang's CPU engine asks for it past one rank per NUMA node).
TP2 = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
LENGTHS = [1, 64, 257, 1500]
CONCURRENT = [40, 300, 900]


@pytest.fixture(scope="module")
def reference_tp2(model, logdir) -> dict:
    """Greedy outputs of a plain TP-2 server; stopped before any prefill/decode pair starts."""
    return plain_outputs("plain-tp2", model, logdir, prompts_of(LENGTHS, seed=7) + prompts_of(CONCURRENT, seed=8),
                         ["--tp", "2"], TP2)


@pytest.fixture(scope="module", params=["kvconnect-nixl", "kvconnect-mooncake"])
def pd_tp2(request, model, logdir, reference_tp2):
    """A TP-2 prefill and a TP-2 decode with one kvconnect backend behind the router."""
    pair = PDSet(model, logdir, request.param, env={**TP2, "KVCONNECT_SGLANG_PAGE_DIGESTS": "1"}, tag="tp2-",
                 extra=["--tp", "2"])
    yield pair
    pair.stop()


def _digests(path) -> dict[tuple[str, str], str]:
    """(room, rank) -> digest of the pages a server held (prefill) or loaded (decode)."""
    found = re.findall(r"kvconnect sglang digest room=(\d+) pages=\d+ sha256=(\w+) rank=(\d+)",
                       path.read_text(errors="replace"))
    return {(room, rank): sha for room, sha, rank in found}


def test_tp2_greedy_tokens_and_every_ranks_pages_match(pd_tp2, reference_tp2):
    prompts = prompts_of(LENGTHS, seed=7)
    got = generate_all(pd_tp2.url, prompts)
    bad = _compare(got, prompts, reference_tp2)
    prompts_c = prompts_of(CONCURRENT, seed=8)
    bad += _compare(generate_all(pd_tp2.url, prompts_c, concurrent=len(prompts_c)), prompts_c, reference_tp2)
    print(f"{pd_tp2.backend} TP 2: tokens matched {len(prompts) + len(prompts_c) - len(bad)}/"
          f"{len(prompts) + len(prompts_c)}")
    assert not bad, bad
    held, loaded = _digests(pd_tp2.prefill.log), _digests(pd_tp2.decode.log)
    ranks = {rank for _, rank in loaded}
    assert ranks == {"0", "1"}, f"decode ranks that logged loads: {sorted(ranks)}"
    assert len(loaded) >= 2 * (len(prompts) + len(prompts_c)), f"decode logged {len(loaded)} rank loads"
    differ = {key: (held.get(key), sha) for key, sha in loaded.items() if held.get(key) != sha}
    print(f"{pd_tp2.backend} TP 2: pages equal for {len(loaded) - len(differ)}/{len(loaded)} rank loads")
    assert not differ, differ
    # The two ranks hold different heads: equal digests would mean one rank's pages were taken for both.
    rooms = {room for room, _ in loaded}
    assert all(loaded[(r, "0")] != loaded[(r, "1")] for r in rooms if (r, "0") in loaded and (r, "1") in loaded)


# The refusal is the adapter's, before any transport: one backend's pair serves as the TP-2 prefill.
@pytest.mark.parametrize("pd_tp2", ["kvconnect-nixl"], indirect=True)
def test_a_decode_of_another_tp_size_is_refused_and_keeps_serving(pd_tp2, model, logdir):
    decode, base = sglang(f"decode-tp1-{pd_tp2.backend}", model, logdir, [
        "--disaggregation-transfer-backend", pd_tp2.backend, "--disaggregation-mode", "decode",
        "--disaggregation-decode-retraction-backup", "cpu_tensor"], env={"KVCONNECT_SGLANG_PAGE_DIGESTS": "1"})
    try:
        decode.wait_ready(time.monotonic() + 900)
        t0 = time.monotonic()
        out = generate(base, prompts_of([64], seed=9)[0], extra={
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd_tp2.bootstrap, "bootstrap_room": random.randrange(2**63)})
        took = time.monotonic() - t0
        assert "error" in out, out
        assert took < 120, f"the refused request took {took:.0f} s"
        log = decode.log.read_text(errors="replace")
        assert "kvconnect pairs equal TP sizes only" in log
        assert "kvconnect sglang digest" not in log and decode.proc.poll() is None
    finally:
        decode.stop()
