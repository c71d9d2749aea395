"""Lower offload tiers through vLLM: a prefix one engine computed is loaded by another engine process.

Engine A serves prompts with KVConnectOffload and a lower tier (Mooncake Store, or a local disk), and
waits until its blocks were written down; then A is gone, and engine B (a new process with an empty
host pool) serves the same prompts: its prefix comes up from the tier, verified page by page, and
its greedy tokens equal A's, which computed everything itself.
"""

from __future__ import annotations

import pytest

from harness import Engine, kv_config, prompts_of, read_stats, wait_for

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8


def _engine(model, tmp_path, name: str, tier: dict, **kv) -> tuple[Engine, object]:
    stats = tmp_path / f"{name}.json"
    extra = {"cpu_bytes": 64 << 20, "stats_path": str(stats), "tiers": [tier]}
    engine = Engine(model, kv=kv_config("KVConnectOffload", "kv_both", kv_connector_extra_config=extra, **kv),
                    core="nobind", name=name, llm={"enable_prefix_caching": True})
    engine.wait_ready()
    return engine, stats


def _tokens(out: dict) -> list[list[int]]:
    return [o["token_ids"] for o in out["outputs"]]


@pytest.fixture(params=["store", "disk"])
def tier(request, tmp_path):
    if request.param == "disk":
        yield {"kind": "disk", "path": str(tmp_path / "kv-disk"), "max_gib": 1.0}
        return
    from kvconnect.offload.tiers.local_store import LocalStore

    store = LocalStore(tmp_path).start()
    try:
        yield {"kind": "store", "master": store.address}
    finally:
        store.stop()


def _served_by_a(model, tmp_path, tier: dict, prompts) -> tuple[list[list[int]], int]:
    """Engine A serves `prompts` and writes their blocks down; (its tokens, blocks stored). A is gone after."""
    A, a_stats = _engine(model, tmp_path, f"tier-{tier['kind']}-a", tier)
    try:
        first = A.generate(prompts, max_tokens=MAX_TOKENS)

        def written() -> int:
            # Both stores were planned when the requests finished; the scheduler hears of a finished
            # store and of its write-down at the engine's next steps: give it some.
            A.generate(prompts_of([3], seed=1), max_tokens=1)
            s = read_stats(a_stats)
            return s["in_flight"] == 0 and s["stores"] > 0 and s["written_down"] == s["stores"] and s["stores"]

        stored = wait_for(written, 60, "engine A to store its blocks and write them down to the tier")
    finally:
        A.close()
    return _tokens(first), stored


def test_a_prefix_stored_by_one_engine_is_loaded_by_the_next(tiny_llama, tmp_path, tier):
    # Lengths whose 8 generated tokens complete no further block: what A stores (its full blocks) is
    # exactly what B can take from the tier (every full block before the last prompt token).
    prompts = prompts_of([300, 700], seed=31)
    first, stored = _served_by_a(tiny_llama, tmp_path, tier, prompts)
    B, b_stats = _engine(tiny_llama, tmp_path, f"tier-{tier['kind']}-b", tier)
    try:
        second = B.generate(prompts, max_tokens=MAX_TOKENS)
        after = wait_for(lambda: (s := read_stats(b_stats)) and s.get("promoted", 0) >= stored and s, 60,
                         "engine B to bring the prefix up from the tier")
        print(f"{tier['kind']} tier: engine A stored {stored} blocks; engine B:", after)
        assert after["tier_hits"] == after["promoted"] == stored and after["promote_failed"] == 0
        assert after["bytes_promoted"] == stored * after["bytes_stored_per_block"]
        assert _tokens(second) == first
    finally:
        B.close()


def test_a_corrupt_page_on_disk_is_recomputed_not_used(tiny_llama, tmp_path):
    tier = {"kind": "disk", "path": str(tmp_path / "kv-disk"), "max_gib": 1.0}
    prompts = prompts_of([700], seed=32)
    first, stored = _served_by_a(tiny_llama, tmp_path, tier, prompts)
    (batch,) = (tmp_path / "kv-disk").glob("*.kvt")
    raw = bytearray(batch.read_bytes())
    raw[-100] ^= 0xFF  # the last bytes of the file: the last page of the last region
    batch.write_bytes(bytes(raw))
    B, b_stats = _engine(tiny_llama, tmp_path, "tier-disk-corrupt-b", tier, kv_load_failure_policy="recompute")
    try:
        second = B.generate(prompts, max_tokens=MAX_TOKENS)
        after = wait_for(lambda: (s := read_stats(b_stats)) and s.get("promote_failed", 0) and s, 60,
                         "engine B to report the failed promotion")
        print("corrupt disk page, engine B:", after)
        assert after["tier_hits"] == stored and after["promoted"] == 0
        assert after["disk_pages"] == stored - 1  # the corrupt page left the scheduler's index
        assert _tokens(second) == first  # recomputed, never computed from the flipped page

        def settled() -> bool:
            B.generate(prompts_of([3], seed=1), max_tokens=1)  # a step to report the recomputed request's store
            return read_stats(b_stats)["in_flight"] == 0

        wait_for(settled, 60, "every slot of the failed promotion to be freed or reused")
    finally:
        B.close()
