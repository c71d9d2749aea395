"""kvconnect as SGLang's transfer backend with tensor parallelism: prefill and decode of TP 2 and 2, 2 and 1,
1 and 2.

Every decode rank gathers the params of every prefill rank and reads, from each, the KV heads it holds
(all of a rank's heads between equal sizes, part of a page's heads between different ones). Greedy
tokens and logprobs equal a plain server's of the decode's TP size, and every KV head of every
request's pages on decode equals that head on the prefill byte for byte (digests per global head).
"""

import re

import pytest

from harness import PDSet, generate_all, plain_outputs, prompts_of, tp_args
from test_pd_e2e import _compare

pytestmark = pytest.mark.timeout(2400)

LENGTHS = [1, 64, 257, 1500]
CONCURRENT = [40, 300, 900]
PROMPTS = prompts_of(LENGTHS, seed=7) + prompts_of(CONCURRENT, seed=8)


@pytest.fixture(scope="module")
def references(model, logdir) -> dict[int, dict]:
    """Greedy outputs of plain servers of TP 1 and TP 2, by TP size; each stopped before any pair starts."""
    return {tp: plain_outputs(f"plain-tp{tp}", model, logdir, PROMPTS, *tp_args(tp)) for tp in (1, 2)}


@pytest.fixture(scope="module")
def pd_tp(request, model, logdir, references):
    """A prefill and a decode of the TP sizes `request.param` names, one kvconnect backend, behind the router
    (one set alive at a time: each test names its sets)."""
    backend, tp = request.param
    pair = PDSet(model, logdir, backend, env={"KVCONNECT_SGLANG_PAGE_DIGESTS": "1"}, tag=f"tp{tp[0]}{tp[1]}-", tp=tp)
    pair.tp = tp
    yield pair
    pair.stop()


_HEADS = re.compile(r"kvconnect sglang head digests room=(\d+) heads=([\w:,]+) aux=(\w+) rank=(\d+)")


def _head_digests(path) -> tuple[dict[tuple[str, int], str], dict[str, set[str]]]:
    """((room, global KV head) -> digest, room -> aux digests) a server logged, over all its ranks."""
    heads, aux = {}, {}
    for room, per_head, aux_sha, _ in _HEADS.findall(path.read_text(errors="replace")):
        for item in per_head.split(","):
            head, sha = item.split(":")
            heads[(room, int(head))] = sha
        aux.setdefault(room, set()).add(aux_sha)
    return heads, aux


def _run(pair, references) -> None:
    ref = references[pair.tp[1]]
    name = f"{pair.backend} TP {pair.tp[0]} -> {pair.tp[1]}"
    one = prompts_of(LENGTHS, seed=7)
    bad = _compare(generate_all(pair.url, one), one, ref)
    many = prompts_of(CONCURRENT, seed=8)
    bad += _compare(generate_all(pair.url, many, concurrent=len(many)), many, ref)
    print(f"{name}: tokens matched {len(PROMPTS) - len(bad)}/{len(PROMPTS)}")
    assert not bad, bad
    (held, held_aux), (loaded, loaded_aux) = _head_digests(pair.prefill.log), _head_digests(pair.decode.log)
    rooms = {room for room, _ in loaded}
    # Every request's every head on decode (2 KV heads in the test model), whichever ranks hold it.
    assert len(rooms) >= len(PROMPTS) and all((r, h) in loaded for r in rooms for h in (0, 1)), sorted(loaded)
    differ = {key: (held.get(key), sha) for key, sha in loaded.items() if held.get(key) != sha}
    print(f"{name}: heads equal for {len(loaded) - len(differ)}/{len(loaded)} (request, head) pairs")
    assert not differ, differ
    # The aux rows (first token, logprobs) are the same on every prefill rank; decode read one of them.
    assert all(loaded_aux[r] <= held_aux.get(r, set()) for r in rooms), (loaded_aux, held_aux)
    # The heads differ from each other: equal digests would mean one head's bytes were taken for both.
    assert all(loaded[(r, 0)] != loaded[(r, 1)] for r in rooms)


@pytest.mark.parametrize("pd_tp", [("kvconnect-nixl", (2, 2)), ("kvconnect-mooncake", (2, 2))], indirect=True,
                         ids=["nixl", "mooncake"])
def test_tp2_to_tp2_greedy_tokens_and_every_head_match(pd_tp, references):
    _run(pd_tp, references)


@pytest.mark.parametrize("pd_tp", [("kvconnect-nixl", (2, 1)), ("kvconnect-mooncake", (1, 2))], indirect=True,
                         ids=["nixl-2-to-1", "mooncake-1-to-2"])
def test_between_tp_sizes_greedy_tokens_and_every_head_match(pd_tp, references):
    """A TP-1 decode reads each page's heads from both TP-2 prefill ranks; TP-2 decode ranks read each
    their head from the one TP-1 prefill."""
    _run(pd_tp, references)
