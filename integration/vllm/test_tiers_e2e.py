"""Lower offload tiers through vLLM: a prefix one engine computed is loaded by another engine process.

Engine A serves prompts with KVConnectOffload over a local disk and a Mooncake Store, and waits until
their blocks were written down to both; then A is gone, and new engines (new processes with empty host
pools) serve the same prompts: one over the store alone, one over the disk alone, each bringing the
prefix up from its tier, verified page by page, with the greedy tokens of A, which computed everything
itself; and one over a copy of the disk with a flipped byte, which recomputes rather than use it.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from harness import Engine, kv_config, outcome, prompts_of, read_stats, result_of, wait_for

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
# Lengths whose 8 generated tokens complete no further block: what A stores (its full blocks) is exactly
# what a later engine can take from the tier (every full block before the last prompt token).
LENGTHS = [300, 700]


def _engine(model, d, name: str, tiers: list[dict], **kv) -> tuple[Engine, object]:
    """An engine (still starting) with a host pool over `tiers` (`kv`: more of vLLM's KV config)."""
    stats = d / f"{name}.json"
    extra = {"cpu_bytes": 64 << 20, "stats_path": str(stats), "tiers": tiers}
    engine = Engine(model, kv=kv_config("KVConnectOffload", "kv_both", kv_connector_extra_config=extra, **kv),
                    core="nobind", name=name, llm={"enable_prefix_caching": True})
    return engine, stats


def _tokens(out: dict) -> list[list[int]]:
    return [o["token_ids"] for o in out["outputs"]]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """A's tokens and stores, then what each later engine served and counted."""
    from kvconnect.offload.tiers.local_store import LocalStore

    d = tmp_path_factory.mktemp("tiers")
    store = LocalStore(d).start()
    try:
        yield _served(tiny_llama, d, {"kind": "disk", "path": str(d / "kv-disk"), "max_gib": 1.0},
                      {"kind": "store", "master": store.address})
    finally:
        store.stop()


def _served(model, d, disk: dict, shared: dict) -> SimpleNamespace:
    prompts, lone = prompts_of(LENGTHS, seed=31), prompts_of([700], seed=32)
    A, a_stats = _engine(model, d, "tier-a", [disk, shared])
    try:
        first, stored = _served_by_a(A, a_stats, prompts, 0)
        before = set((d / "kv-disk").glob("*.kvt"))
        # The corrupt page's test flips a byte of the one batch file this prompt's blocks went to.
        lone_first, lone_stored = _served_by_a(A, a_stats, lone, stored)
        (batch,) = set((d / "kv-disk").glob("*.kvt")) - before
    finally:
        A.close()
    corrupt = d / "kv-disk-corrupt"
    shutil.copytree(disk["path"], corrupt)
    raw = bytearray((corrupt / batch.name).read_bytes())
    raw[-100] ^= 0xFF  # the last bytes of the file: the last page of the last region
    (corrupt / batch.name).write_bytes(bytes(raw))
    # The later engines start together: none reads its tier before it serves.
    starting = {kind: _engine(model, d, f"tier-{kind}-b", [tier]) for kind, tier in (("store", shared), ("disk", disk))}
    starting["corrupt"] = _engine(model, d, "tier-disk-corrupt-b", [{**disk, "path": str(corrupt)}],
                                  kv_load_failure_policy="recompute")
    try:
        loaded = {kind: outcome(_loads, *starting[kind], prompts, stored) for kind in ("store", "disk")}
        recomputed = outcome(_recomputes, *starting["corrupt"], lone)
    finally:
        for engine, _ in starting.values():
            engine.close()
    return SimpleNamespace(first=first, stored=stored, loaded=loaded, lone_first=lone_first, lone_stored=lone_stored,
                           recomputed=recomputed)


def _served_by_a(A: Engine, a_stats, prompts, stored_before: int) -> tuple[list[list[int]], int]:
    """A serves `prompts` and writes their blocks down: (its tokens, the blocks it stored for them)."""
    first = A.generate(prompts, max_tokens=MAX_TOKENS)

    def written() -> int:
        # Both stores were planned when the requests finished; the scheduler hears of a finished
        # store and of its write-down at the engine's next steps: give it some.
        A.generate(prompts_of([3], seed=1), max_tokens=1)
        s = read_stats(a_stats)
        return (s["in_flight"] == 0 and s["stores"] > stored_before and s["written_down"] == s["stores"]
                and s["stores"])

    return _tokens(first), wait_for(written, 60, "engine A to store its blocks and write them down") - stored_before


def _loads(engine: Engine, stats, prompts, stored: int) -> tuple[list[list[int]], dict]:
    """The engine serves `prompts`: (its tokens, its stats once it brought up `stored` blocks)."""
    tokens = _tokens(engine.generate(prompts, max_tokens=MAX_TOKENS))
    after = wait_for(lambda: (s := read_stats(stats)) and s.get("promoted", 0) >= stored and s, 60,
                     f"{engine.name} to bring the prefix up from the tier")
    return tokens, after


def _recomputes(engine: Engine, stats, prompts) -> tuple[list[list[int]], dict]:
    """The engine over the corrupt copy serves `prompts`: (its tokens, its stats once the promotion failed),
    after every slot of the failed promotion was freed or reused."""
    tokens = _tokens(engine.generate(prompts, max_tokens=MAX_TOKENS))
    after = wait_for(lambda: (s := read_stats(stats)) and s.get("promote_failed", 0) and s, 60,
                     "the engine over the corrupt page to report the failed promotion")

    def settled() -> bool:
        engine.generate(prompts_of([3], seed=1), max_tokens=1)  # a step to report the recomputed request's store
        return read_stats(stats)["in_flight"] == 0

    wait_for(settled, 60, "every slot of the failed promotion to be freed or reused")
    return tokens, after


@pytest.mark.parametrize("tier", ["store", "disk"])
def test_a_prefix_stored_by_one_engine_is_loaded_by_the_next(served, tier):
    tokens, after = result_of(served.loaded[tier])
    print(f"{tier} tier: engine A stored {served.stored} blocks; engine B:", after)
    assert after["tier_hits"] == after["promoted"] == served.stored and after["promote_failed"] == 0
    assert after["bytes_promoted"] == served.stored * after["bytes_stored_per_block"]
    assert tokens == served.first


def test_a_corrupt_page_on_disk_is_recomputed_not_used(served):
    tokens, after = result_of(served.recomputed)
    print("corrupt disk page, engine B:", after)
    assert after["tier_hits"] == served.lone_stored and after["promoted"] == 0
    # The corrupt page left the scheduler's index; the copy holds every page A wrote.
    assert after["disk_pages"] == served.stored + served.lone_stored - 1
    assert tokens == served.lone_first  # recomputed, never computed from the flipped page
