"""OffloadConnector end to end on CPU: real bytes stored, evicted and loaded back, compared byte for byte."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import kv_cache, random_bytes_
from kvconnect import BlockRangeError, KVConnectError, LayoutError, TransferError
from kvconnect.layout import KVCacheLayout, MambaPage
from kvconnect.offload import OffloadConnector
from kvconnect.offload.mover import region_rows
from kvconnect.presets import PRESETS
from kvconnect.kvgroups import KVGroup

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8]
GATE_S = 10.0  # bound on every test-side wait for a worker


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as raw bytes (NaNs compare equal as bytes, never as floats)."""
    return t.contiguous().view(torch.uint8)


def _keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def _tier(caches: dict[str, torch.Tensor], slots: int, **kw) -> OffloadConnector:
    from kvconnect.regions import RegionSet

    slot_bytes = sum(r.block_bytes for r in RegionSet.from_kv_caches(caches))
    tier = OffloadConnector(slots * slot_bytes, **kw)
    tier.register_kv_caches(caches)
    assert tier.num_slots == slots
    return tier


def _cache(kind: str, dtype: torch.dtype, dims: tuple[int, int, int, int], blocks: int, seed: int):
    """(flat buffer, tensors to register, per-layer [B, ...] views) for one cache layout of the foundation issue."""
    L, H, N, C = dims
    if kind in KVCacheLayout.__members__:
        layout = KVCacheLayout(kind)
        buf, layers = kv_cache(layout, (L, blocks, H, N, C), dtype, seed)
        return buf, layers, list(layers.values())
    if kind.startswith("cross-"):  # one tensor holding every layer, blocks outermost
        layout = KVCacheLayout(kind.removeprefix("cross-"))
        buf, layers = kv_cache(layout, (L, blocks, H, N, C), dtype, seed)
        phys = [dict(zip("LBHNC", (L, blocks, H, N, C)))[d] for d in layout.value]
        return buf, {"all_layers": buf.view(phys)}, list(layers.values())
    if kind == "mla":  # one latent vector per token, no heads
        buf = random_bytes_(torch.empty(L * blocks * N * C, dtype=dtype), seed)
        layers = {f"layers.{i}.mla": v for i, v in enumerate(buf.view(L, blocks, N, C))}
        return buf, layers, list(layers.values())
    if kind == "hybrid":  # attention pages beside Mamba state pages, one block table
        page = MambaPage([(2, 4), (H, 4)], [torch.float32, torch.bfloat16], page_size_bytes=64)
        attn = random_bytes_(torch.empty(L * blocks * H * N * C, dtype=dtype), seed)
        ssm = random_bytes_(torch.empty(blocks * page.page_size_bytes, dtype=torch.int8), seed + 7)
        layers = {f"layers.{i}.attn": v for i, v in enumerate(attn.view(L, blocks, H, N, C))}
        layers["layers.mamba"] = ssm.view(blocks, 1, 1, page.page_size_bytes)
        return (attn, ssm), layers, list(layers.values())
    raise AssertionError(kind)


LAYOUT_KINDS = ["LBHNC", "LBNHC", "BLHNC", "BLNHC", "cross-BLHNC", "cross-BLNHC", "cross-BHLNC", "mla", "hybrid"]


@st.composite
def round_trips(draw):
    kind = draw(st.sampled_from(LAYOUT_KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    dims = (draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 9)))
    blocks = draw(st.integers(2, 20))
    n = draw(st.integers(1, blocks))
    src = draw(st.lists(st.integers(0, blocks - 1), min_size=n, max_size=n))  # repeats allowed
    dst = draw(st.permutations(range(blocks)))[:n]
    # Force the staging path a fragmented pool takes, with chunks of one block, a few, or all.
    staged = draw(st.sampled_from([None, 1, 200, 1 << 20]))
    return kind, dtype, dims, blocks, src, dst, staged, draw(st.integers(0, 10_000))


@settings(max_examples=120, deadline=None)
@given(round_trips())
def test_store_then_load_round_trips_every_layout_byte_exact(case) -> None:
    kind, dtype, dims, blocks, src, dst, staged, seed = case
    buf, caches, views = _cache(kind, dtype, dims, blocks, seed)
    before = [_bytes(v[i]).clone() for v in views for i in src]
    tier = _tier(caches, len(src) + 1)
    try:
        if staged is not None:
            tier._mover.max_runs, tier._mover.stage_bytes = 0, staged
        keys = _keys("k", len(src))
        tier.wait(tier.store(keys, src), GATE_S)
        # New bytes everywhere: whatever the load does not write must keep them, byte for byte.
        bufs = buf if isinstance(buf, tuple) else (buf,)
        for k, b in enumerate(bufs):
            random_bytes_(b, seed + 100 + k)
        expected = [_bytes(v).clone() for v in views]
        for layer, v in enumerate(expected):
            for d, s in zip(dst, src):
                v[d] = before[layer * len(src) + src.index(s)]
        tier.wait(tier.load(keys, dst), GATE_S)
        for v, want in zip(views, expected):
            assert torch.equal(_bytes(v), want)
        stats = tier.stats()
        assert stats.stores == len(set(keys)) and stats.loads == len(keys)
        assert stats.bytes_loaded == len(keys) * tier.slot_bytes
    finally:
        tier.close()


def test_bit_patterns_that_are_nans_survive_the_wide_word_copies() -> None:
    pages = torch.empty(6, 4, dtype=torch.int64)
    nans = torch.tensor([0x7FF0000000000001, 0x7FF8000000000000, -1, 0x7FF4000000000000], dtype=torch.int64)
    pages[:] = nans
    caches = {"l0": pages.view(torch.float64).view(6, 1, 1, 4)}
    assert region_rows(caches, _tier(caches, 2).regions[0]).dtype == torch.complex128
    tier = _tier(caches, 3)
    tier.wait(tier.store([b"a", b"b"], [0, 1]), GATE_S)
    pages[4:].zero_()
    tier.wait(tier.load([b"a", b"b"], [4, 5]), GATE_S)
    assert torch.equal(pages, nans.expand(6, 4))
    tier.close()


def test_rows_are_views_of_the_registered_memory_in_the_widest_aligned_word() -> None:
    buf, layers = kv_cache(KVCacheLayout.BLHNC, (3, 5, 1, 2, 3), torch.int8, seed=1)  # 6-byte blocks, stride 18
    tier = _tier(layers, 2)
    rows = region_rows(layers, tier.regions[1])
    assert rows.dtype == torch.int16 and rows.data_ptr() == layers["model.layers.1.attn"].data_ptr()
    assert rows.stride(0) * 2 == 18
    odd = {"x": torch.zeros(4, 7, dtype=torch.int8)}
    assert region_rows(odd, _tier(odd, 1).regions[0]).dtype == torch.uint8


def test_prefix_sharing_between_requests_stores_the_prefix_once() -> None:
    buf, caches = kv_cache(KVCacheLayout.LBHNC, (2, 16, 2, 4, 8), torch.bfloat16, seed=3)
    tier = _tier(caches, 8, block_size=4)
    prefix = list(range(12))  # three full blocks
    a, b = prefix + [100, 101, 102, 103, 104], prefix + [200, 201, 202, 203, 7, 7, 7, 7]
    keys_a, keys_b = tier.block_keys(a), tier.block_keys(b)
    assert keys_a[:3] == keys_b[:3] and keys_a[3] != keys_b[3]
    job = tier.wait(tier.store_request(a, [0, 1, 2, 3, 4]))  # the partial 5th block is not stored
    assert job.num_blocks == 4
    assert tier.lookup(keys_b) == 3
    job = tier.wait(tier.store_request(b, [5, 6, 7, 8, 9]))
    assert job.num_blocks == 2 and list(job.block_ids) == [8, 9]  # only the new tail moved
    assert tier.lookup(keys_b) == 5
    snapshot = buf.clone()
    tier.wait(tier.load(keys_b, [10, 11, 12, 13, 14]))
    ref = KVCacheLayout.LBHNC.per_layer_views(snapshot, (2, 16, 2, 4, 8))
    for view, old in zip(caches.values(), ref):
        assert torch.equal(_bytes(view[10:15]), _bytes(old[[0, 1, 2, 8, 9]]))
    s = tier.stats()
    assert (s.stores, s.loads, s.resident) == (6, 5, 6)
    tier.close()


def _one_block_cache(blocks: int):
    buf, caches = kv_cache(KVCacheLayout.LBHNC, (2, blocks, 1, 2, 4), torch.float32, seed=5)
    return buf, caches, KVCacheLayout.LBHNC.per_layer_views(buf, (2, blocks, 1, 2, 4))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_eviction_follows_the_policy_and_survivors_load_their_own_bytes(policy) -> None:
    buf, caches, views = _one_block_cache(16)
    tier = _tier(caches, 4, policy=policy)
    keys = _keys("r", 6)
    for i in range(4):
        tier.wait(tier.store([keys[i]], [i]))
    tier.wait(tier.load([keys[0]], [10]))  # a use of block 0
    tier.wait(tier.store([keys[4]], [4]))
    # LRU evicts the oldest unused (1); ARC evicts from T1 (used once: 1, 2, 3), least recent first.
    assert [tier.lookup([k]) for k in keys[:5]] == [1, 0, 1, 1, 1]
    tier.wait(tier.store([keys[5]], [5]))
    assert tier.lookup([keys[2]]) == 0 and tier.stats().evictions == 2
    tier.wait(tier.load([keys[0], keys[3], keys[4], keys[5]], [12, 13, 14, 15]))
    for v in views:
        assert torch.equal(_bytes(v[12:16]), _bytes(v[[0, 3, 4, 5]]))
    tier.close()


def test_arc_keeps_reused_blocks_through_a_scan_of_one_time_blocks() -> None:
    buf, caches, views = _one_block_cache(16)
    tiers = {p: _tier(caches, 4, policy=p) for p in ("lru", "arc")}
    for tier in tiers.values():
        for k in (b"hot0", b"hot1"):
            tier.wait(tier.store([k], [0]))
            tier.wait(tier.load([k], [1]))
        for i in range(8):
            tier.wait(tier.store([b"scan%d" % i], [2 + i]))
    assert tiers["arc"].lookup([b"hot0"]) == 1 and tiers["arc"].lookup([b"hot1"]) == 1
    assert tiers["lru"].lookup([b"hot0"]) == 0 and tiers["lru"].lookup([b"hot1"]) == 0
    for tier in tiers.values():
        tier.close()


def test_capacity_edges_budget_of_exactly_n_blocks() -> None:
    buf, caches, views = _one_block_cache(32)
    slot = 2 * 2 * 4 * 4
    for cpu_bytes, slots in ((4 * slot, 4), (5 * slot - 1, 4), (slot, 1)):
        tier = OffloadConnector(cpu_bytes)
        tier.register_kv_caches(caches)
        assert tier.num_slots == slots and tier.slot_bytes == slot
        tier.wait(tier.store(_keys("a", slots), range(slots)))
        assert tier.lookup(_keys("a", slots)) == slots and tier.stats().evictions == 0
        tier.wait(tier.store([b"one-more"], [slots]))
        # Exactly one eviction, taken from the tail of the stored prefix.
        assert tier.lookup(_keys("a", slots)) == slots - 1 and tier.manager.held() == slots
        assert tier.lookup([b"one-more"]) == 1
        assert tier.stats().evictions == 1
        tier.close()
    with pytest.raises(KVConnectError, match="cannot hold one block"):
        OffloadConnector(slot - 1).register_kv_caches(caches)


def test_a_request_larger_than_the_tier_stores_the_prefix_that_fits() -> None:
    buf, caches, views = _one_block_cache(32)
    tier = _tier(caches, 5)
    tier.wait(tier.store(_keys("old", 3), [20, 21, 22]))
    keys = _keys("big", 12)
    job = tier.wait(tier.store(keys, range(12)))
    assert job.num_blocks == 5 and tier.lookup(keys) == 5 and tier.stats().dropped == 7
    assert tier.lookup(_keys("old", 3)) == 0
    tier.wait(tier.load(keys[:5], range(25, 30)))
    for v in views:
        assert torch.equal(_bytes(v[25:30]), _bytes(v[0:5]))
    tier.close()


class _Gate:
    """Holds a mover method until released, so a job stays in flight as long as a test needs."""

    def __init__(self, monkeypatch, mover, name: str):
        self.started, self.release = threading.Event(), threading.Event()
        real = getattr(mover, name)

        def gated(*args, **kw):
            self.started.set()
            assert self.release.wait(GATE_S), "gate never released"
            return real(*args, **kw)

        monkeypatch.setattr(mover, name, gated)


def test_blocks_in_flight_are_never_evicted_and_waits_are_bounded(monkeypatch) -> None:
    buf, caches, views = _one_block_cache(16)
    tier = _tier(caches, 3, workers=2)  # the second worker runs the store while the load is held
    tier.wait(tier.store(_keys("a", 3), [0, 1, 2]))
    gate = _Gate(monkeypatch, tier._mover, "load")
    load = tier.load([b"a0"], [8])  # a0 pinned while its load is held at the gate
    assert gate.started.wait(GATE_S)
    with pytest.raises(TransferError, match="did not complete within"):
        tier.wait(load, timeout=0.01)
    store = tier.wait(tier.store(_keys("n", 3), [3, 4, 5]))  # only a1 and a2 may go
    assert store.num_blocks == 2 and tier.lookup([b"a0"]) == 1 and tier.stats().dropped == 1
    assert not load.done
    gate.release.set()
    tier.wait(load, GATE_S)
    for v in views:
        assert torch.equal(_bytes(v[8]), _bytes(v[0]))
    assert tier.manager.pinned() == 0
    tier.close()


def test_a_block_is_invisible_while_its_store_is_in_flight(monkeypatch) -> None:
    buf, caches, views = _one_block_cache(8)
    tier = _tier(caches, 4, workers=2)
    gate = _Gate(monkeypatch, tier._mover, "store")
    job = tier.store(_keys("s", 2), [0, 1])
    assert gate.started.wait(GATE_S)
    assert tier.lookup(_keys("s", 2)) == 0
    with pytest.raises(KVConnectError, match="being stored"):
        tier.load([b"s0"], [5])
    assert tier.wait(tier.store(_keys("s", 2), [0, 1])).num_blocks == 0  # already in flight: not twice
    gate.release.set()
    tier.wait(job, GATE_S)
    assert tier.lookup(_keys("s", 2)) == 2
    tier.close()


def test_a_failed_store_publishes_nothing_and_is_reported(monkeypatch) -> None:
    buf, caches, views = _one_block_cache(8)
    tier = _tier(caches, 4)
    real = tier._mover.store

    def half_then_fail(ids, slots, *a, **kw):
        real(ids[:1], slots[:1], *a, **kw)  # some bytes really landed before the failure
        raise RuntimeError("copy engine fell over")

    monkeypatch.setattr(tier._mover, "store", half_then_fail)
    job = tier.store(_keys("f", 3), [0, 1, 2])
    with pytest.raises(TransferError, match="store job .* failed: copy engine fell over"):
        tier.wait(job, GATE_S)
    assert tier.poll() == [job] and not job.ok and isinstance(job.error, RuntimeError)
    assert tier.lookup(_keys("f", 3)) == 0 and tier.manager.held() == 0
    s = tier.stats()
    assert (s.failed_stores, s.stores, s.bytes_stored, s.in_flight) == (1, 0, 0, 0)
    monkeypatch.undo()
    tier.wait(tier.store(_keys("f", 3), [0, 1, 2]))
    assert tier.lookup(_keys("f", 3)) == 3
    tier.close()


def test_a_failed_load_unpins_and_keeps_the_blocks(monkeypatch) -> None:
    buf, caches, views = _one_block_cache(8)
    tier = _tier(caches, 4)
    tier.wait(tier.store(_keys("k", 2), [0, 1]))
    monkeypatch.setattr(tier._mover, "load", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(TransferError, match="boom"):
        tier.wait(tier.load(_keys("k", 2), [4, 5]), GATE_S)
    assert tier.manager.pinned() == 0 and tier.lookup(_keys("k", 2)) == 2 and tier.stats().failed_loads == 1
    tier.close()


@pytest.mark.parametrize(
    ("call", "ids", "error", "message"),
    [("load", [3, 16], BlockRangeError, "block id 16 at position 1 is out of range"),
     ("load", [-1, 2], BlockRangeError, "block id -1"),
     ("load", [1.5, 2], BlockRangeError, "must be integers"),
     ("load", [4, 4], BlockRangeError, "block id 4 appears twice"),
     ("load", [4], BlockRangeError, "2 keys but 1 block ids"),
     ("store", [0, 99], BlockRangeError, "block id 99"),
     ("store", [0, 1, 2], BlockRangeError, "2 keys but 3 block ids")],
)
def test_bad_block_ids_are_rejected_before_any_copy(call, ids, error, message) -> None:
    buf, caches, views = _one_block_cache(16)
    tier = _tier(caches, 4)
    tier.wait(tier.store(_keys("k", 2), [0, 1]))
    tier.poll()
    before, stats_before = buf.clone(), tier.stats()
    with pytest.raises(error, match=message):
        getattr(tier, call)(_keys("k", 2), ids)
    assert torch.equal(_bytes(buf), _bytes(before))
    assert tier.stats() == stats_before and tier.manager.pinned() == 0 and tier.poll() == []
    tier.close()


def test_unknown_keys_are_misses_and_loading_them_is_refused_before_any_copy() -> None:
    buf, caches, views = _one_block_cache(8)
    tier = _tier(caches, 4)
    assert tier.lookup([b"never", b"seen"]) == 0 and tier.lookup([]) == 0
    assert tier.stats().misses == 2
    before = buf.clone()
    with pytest.raises(KVConnectError, match="position 0 is not in the offload tier"):
        tier.load([b"never"], [1])
    assert torch.equal(_bytes(buf), _bytes(before)) and tier.poll() == []
    assert tier.wait(tier.load_prefix([b"never"], [1])).num_blocks == 0  # a miss: nothing to copy
    assert torch.equal(_bytes(buf), _bytes(before))
    tier.close()


def test_load_prefix_loads_the_leading_hits_into_the_leading_block_ids() -> None:
    buf, caches, views = _one_block_cache(16)
    tier = _tier(caches, 4)
    tier.wait(tier.store(_keys("k", 3), [0, 1, 2]))
    job = tier.wait(tier.load_prefix(_keys("k", 2) + [b"gap", b"k2"], [9, 8, 7, 6]))
    assert job.num_blocks == 2 and list(job.block_ids) == [9, 8]
    for v in views:
        assert torch.equal(_bytes(v[[9, 8]]), _bytes(v[[0, 1]]))
    assert tier.manager.pinned() == 0 and tier.stats().hits == 2
    with pytest.raises(BlockRangeError, match="block id 16"):
        tier.load_prefix(_keys("k", 2), [3, 16])  # every id is checked, not only the hits
    tier.close()


def test_concurrent_stores_and_loads_of_overlapping_prefixes() -> None:
    # Source blocks never change: block (branch, position) holds that position of that branch, and
    # branches share their first 6 blocks, so equal keys always name equal bytes.
    shared, branch_len, branches, bs = 6, 4, 4, 2
    src_blocks = shared + branches * branch_len
    workers = 4
    dst_per_worker = shared + branch_len
    total = src_blocks + workers * dst_per_worker
    buf, caches, views = _one_block_cache(total)
    tier = _tier(caches, 10, block_size=bs, workers=2)
    tokens = [list(range(shared * bs)) + [1000 * (b + 1) + t for t in range(branch_len * bs)] for b in range(branches)]
    tables = [list(range(shared)) + [shared + b * branch_len + i for i in range(branch_len)] for b in range(branches)]
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        rng = np.random.default_rng(w)
        dst = list(range(src_blocks + w * dst_per_worker, src_blocks + (w + 1) * dst_per_worker))
        try:
            for _ in range(25):
                b = int(rng.integers(branches))
                keys = tier.block_keys(tokens[b])
                if rng.random() < 0.5:
                    tier.wait(tier.store(keys, tables[b]), GATE_S)
                    continue
                if rng.random() < 0.5:
                    job = tier.load_prefix(keys, dst)  # lookup and pin in one step
                else:
                    n = tier.lookup(keys)
                    try:
                        job = tier.load(keys[:n], dst[:n])
                    except KVConnectError:
                        continue  # evicted between lookup and load by another thread: refused, not copied
                n = tier.wait(job, GATE_S).num_blocks
                for v in views:
                    assert torch.equal(_bytes(v[dst[:n]]), _bytes(v[tables[b][:n]]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    s = tier.stats()
    assert s.in_flight == 0 and tier.manager.pinned() == 0 and tier.manager.held() <= 10
    assert s.failed_stores == s.failed_loads == 0 and s.loads > 0 and s.stores > 0
    tier.close()


def test_poll_reports_each_finished_job_once_and_stats_count_bytes() -> None:
    buf, caches, views = _one_block_cache(8)
    tier = _tier(caches, 4)
    jobs = [tier.store(_keys("p", 2), [0, 1]), tier.store(_keys("q", 1), [2])]
    for j in jobs:
        tier.wait(j)
    load = tier.wait(tier.load(_keys("p", 2), [5, 6]))
    assert tier.poll() == jobs + [load] and tier.poll() == []
    s = tier.stats()
    assert (s.stores, s.loads, s.bytes_stored, s.bytes_loaded) == (3, 2, 3 * 64, 2 * 64)
    assert s.bytes_moved == 5 * 64 and load.nbytes == 128
    tier.close()


def test_registration_and_lifecycle_errors() -> None:
    with pytest.raises(KVConnectError, match="cpu_bytes"):
        OffloadConnector(0)
    tier = OffloadConnector(1 << 20)
    with pytest.raises(KVConnectError, match="register_kv_caches before"):
        tier.lookup([b"x"])
    with pytest.raises(LayoutError, match="not one contiguous run"):
        tier.register_kv_caches(kv_cache(KVCacheLayout.LHBNC, (2, 4, 2, 4, 8), torch.float16, seed=0)[1])
    caches = {"a": torch.zeros(4, 8)}
    tier.register_kv_caches(caches)
    with pytest.raises(KVConnectError, match="already called"):
        tier.register_kv_caches(caches)
    tier.close()
    with pytest.raises(KVConnectError, match="closed"):
        tier.store([b"x"], [0])
    tier.close()  # idempotent


def test_a_model_shaped_cache_round_trips() -> None:
    caches, groups = PRESETS["hybrid"].allocate(6)
    for k, t in enumerate(caches.values()):
        random_bytes_(t, k)
    tier = _tier(caches, 3, policy="arc")
    keys = tier.block_keys(list(range(48)))
    tier.wait(tier.store(keys, [0, 2, 4]))
    snapshot = {n: t.clone() for n, t in caches.items()}
    tier.wait(tier.load(keys, [1, 3, 5]))
    for name, t in caches.items():
        assert torch.equal(_bytes(t[[1, 3, 5]]), _bytes(snapshot[name][[0, 2, 4]])), name
    tier.close()


def test_close_is_bounded_and_cancels_what_a_stuck_worker_left_queued(monkeypatch) -> None:
    buf, caches, views = _one_block_cache(8)
    tier = _tier(caches, 4)
    gate = _Gate(monkeypatch, tier._mover, "store")
    stuck = tier.store([b"s"], [0])
    assert gate.started.wait(GATE_S)
    queued = tier.store([b"q"], [1])
    with pytest.raises(TransferError, match="still copying after 0.05 s"):
        tier.close(timeout=0.05)
    assert queued.done and isinstance(queued.error, TransferError) and "cancelled" in str(queued.error)
    assert tier.manager.slot_of(b"q") is None  # its slot went back
    gate.release.set()
    tier.wait(stuck, GATE_S)
    tier.close()
    with pytest.raises(KVConnectError, match="closed"):
        tier.lookup([b"s"])


# ---- KV-cache groups (hybrid models) ----

PAGE = 512  # bytes of one block of one shared tensor, as vLLM pads every group's page to one size
STATE = 200  # bytes of a Mamba layer's real state inside that page


def _vllm_hybrid(blocks: int, seed: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[KVGroup]]:
    """vLLM's hybrid layout: each shared tensor is one attention layer's pages and one Mamba layer's state pages."""
    bufs = [random_bytes_(torch.empty(blocks * PAGE, dtype=torch.uint8), seed + k) for k in range(2)]
    caches: dict[str, torch.Tensor] = {}
    for k, buf in enumerate(bufs):
        caches[f"layers.{2 * k}.mamba"] = buf.view(torch.int8).as_strided((blocks, 1, 1, STATE), (PAGE, STATE, STATE, 1))
        caches[f"layers.{2 * k + 1}.attn"] = buf.view(torch.float32).view(blocks, 2, 4, PAGE // 32)
    groups = [KVGroup(layers=("layers.0.mamba", "layers.2.mamba"), label="MambaSpec", block_size=64),
              KVGroup(layers=("layers.1.attn", "layers.3.attn"), label="FullAttentionSpec", block_size=4)]
    return bufs, caches, groups


def _pages(bufs: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [b.view(-1, PAGE)[ids].clone() for b in bufs]


def test_hybrid_groups_store_and_load_by_their_own_block_tables_and_keys() -> None:
    bufs, caches, groups = _vllm_hybrid(blocks=16, seed=5)
    tier = OffloadConnector(8 * 2 * PAGE, block_size=4)
    regions = tier.register_kv_caches(caches, groups)
    assert len(regions) == 2 and tier.num_slots == 8  # aliases merged: one region per shared tensor
    tokens = np.arange(64)
    attn_keys, mamba_keys = tier.block_keys(tokens, group=1), tier.block_keys(tokens, group=0)
    assert len(attn_keys) == 16 and len(mamba_keys) == 1  # each group's own tokens per block
    assert not set(attn_keys) & set(mamba_keys) and tier.block_keys(tokens[:4], group=0) == []
    want_attn, want_state = _pages(bufs, [3, 4, 5]), _pages(bufs, [9])
    tier.wait(tier.store(attn_keys[:3], [3, 4, 5], group=1))
    tier.wait(tier.store(mamba_keys, [9], group=0))
    assert tier.lookup(attn_keys) == 3 and tier.lookup(mamba_keys) == 1
    for b in bufs:
        b.zero_()
    tier.wait(tier.load(mamba_keys, [0], group=0))
    tier.wait(tier.load_prefix(attn_keys[:4], [10, 11, 12, 13], group=1))
    assert all(torch.equal(g, w) for g, w in zip(_pages(bufs, [10, 11, 12]), want_attn))
    assert all(torch.equal(g, w) for g, w in zip(_pages(bufs, [0]), want_state))
    assert all(int(b.view(-1, PAGE)[13].count_nonzero()) == 0 for b in bufs)  # the miss wrote nothing
    stats = tier.stats()
    assert stats.bytes_stored == 4 * 2 * PAGE and stats.bytes_loaded == 4 * 2 * PAGE
    tier.close()


def test_a_group_copies_only_its_own_regions() -> None:
    """Groups over disjoint tensors: storing and loading one group never reads or writes the other's."""
    bufs = [random_bytes_(torch.empty(8 * PAGE, dtype=torch.uint8), 40 + k) for k in range(3)]
    caches = {f"layers.{k}": b.view(8, PAGE) for k, b in enumerate(bufs)}
    groups = [KVGroup(layers=("layers.0", "layers.1"), label="full"), KVGroup(layers=("layers.2",), label="sliding")]
    tier = OffloadConnector(4 * 3 * PAGE)
    tier.register_kv_caches(caches, groups)
    keys = _keys("full", 2)
    want = _pages(bufs, [1, 2])
    tier.wait(tier.store(keys, [1, 2], group=0))
    for b in bufs:
        b.zero_()
    before = bufs[2].clone()
    tier.wait(tier.load(keys, [5, 6], group=0))
    assert all(torch.equal(g, w) for g, w in zip(_pages(bufs[:2], [5, 6]), want[:2]))
    assert torch.equal(bufs[2], before)
    assert tier.stats().bytes_loaded == 2 * 2 * PAGE
    tier.close()


def test_group_bad_input_is_refused_before_any_copy() -> None:
    bufs, caches, groups = _vllm_hybrid(blocks=4, seed=6)
    with pytest.raises(LayoutError, match="names layers that were not registered"):
        OffloadConnector(1 << 20).register_kv_caches(caches, [*groups, KVGroup(layers=("layers.9.attn",))])
    with pytest.raises(LayoutError, match="in no group"):
        OffloadConnector(1 << 20).register_kv_caches(caches, groups[:1])
    with pytest.raises(KVConnectError, match="non-empty list of KVGroup"):
        OffloadConnector(1 << 20).register_kv_caches(caches, [])
    tier = OffloadConnector(4 * 2 * PAGE)
    tier.register_kv_caches(caches, groups)
    with pytest.raises(KVConnectError, match="group must be an index"):
        tier.store(_keys("k", 1), [0], group=2)
    with pytest.raises(KVConnectError, match="group must be an index"):
        tier.block_keys(np.arange(8), group=-1)
    with pytest.raises(BlockRangeError):
        tier.store(_keys("k", 1), [4], group=1)
    assert tier.manager.held() == 0
    tier.close()
