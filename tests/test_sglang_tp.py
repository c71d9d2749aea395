"""The SGLang adapter between attention TP sizes, without SGLang: a rank's pages split by KV head the way
SGLang lays them out, a decode rank combines every prefill rank's params into one load, and layouts
kvconnect does not pair are named (the SGLang e2e moves real pages, `make e2e-sglang`)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvconnect import wire
from kvconnect.errors import LayoutError
from kvconnect.integrations.sglang import buffers
from kvconnect.integrations.sglang.digest import head_digests
from kvconnect.integrations.sglang.gather import RankParams, unpaired
from kvconnect.shards import page_slices

PAGE, HEADS, DIM, PAGES = 4, 4, 8, 6


def _held(kv: list[torch.Tensor], aux: list[torch.Tensor], tp: int, rank: int) -> buffers.Buffers:
    args = SimpleNamespace(kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.nbytes for t in kv],
                           kv_item_lens=[t[:PAGE].nbytes for t in kv], aux_data_ptrs=[t.data_ptr() for t in aux],
                           aux_data_lens=[t.nbytes for t in aux], aux_item_lens=[t[0].nbytes for t in aux],
                           page_size=PAGE, state_types=[], kv_head_num=max(HEADS // tp, 1), total_kv_head_num=HEADS)
    return buffers.from_kv_args(args, "cpu", tp=tp, rank=rank)


def _server(tp: int, full: list[torch.Tensor], aux: torch.Tensor) -> list[tuple[list[torch.Tensor], buffers.Buffers]]:
    """Each rank of a server of `tp` ranks: its own heads of `full` (SGLang's `[slots, heads, dim]` per buffer)."""
    out = []
    for r in range(tp):
        n = HEADS // tp
        kv = [t[:, r * n:(r + 1) * n].contiguous() for t in full]
        rank_aux = [aux.clone()]
        out.append((kv + rank_aux, _held(kv, rank_aux, tp, r)))
    return out


@pytest.fixture
def full() -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(3)
    return [torch.randn(PAGES * PAGE, HEADS, DIM, dtype=torch.float16) for _ in range(4)], torch.randn(5, 16)


@pytest.mark.parametrize("tp, peer_tp", [(1, 2), (2, 1), (1, 4), (4, 2), (2, 2)])
def test_a_rank_assembles_its_heads_of_a_page_from_the_peer_ranks_that_hold_them(full, tp, peer_tp) -> None:
    kv_full, aux = full
    mine, theirs = _server(tp, kv_full, aux), _server(peer_tp, kv_full, aux)
    page = 3
    for rank, (tensors, held) in enumerate(mine):
        got = {name: np.zeros_like(t.numpy()[page]) for name, t in held.tensors.items()}
        for peer_rank, (_, peer) in enumerate(theirs):
            for name in held.tensors:
                lo, ro, n = page_slices(held.shards()[name], tp, rank, peer.shards()[name], peer_tp, peer_rank)
                src = peer.tensors[name].numpy()[page]
                for a, b, k in zip(lo, ro, n):  # a test's reference copy, one run at a time
                    got[name][a:a + k] = src[b:b + k]
        for name, t in held.tensors.items():
            assert np.array_equal(got[name], t.numpy()[page]), (tp, rank, peer_tp, name)


def test_head_digests_name_global_heads_so_servers_of_different_tp_sizes_compare(full) -> None:
    kv_full, aux = full
    pages = np.array([1, 4, 5])
    (_, whole), = _server(1, kv_full, aux)
    heads, aux_sha = head_digests(whole, pages, 2)
    assert sorted(heads) == list(range(HEADS)) and len(set(heads.values())) == HEADS
    for tp in (2, 4):
        for _, held in _server(tp, kv_full, aux):
            part, part_aux = head_digests(held, pages, 2)
            assert part == {g: heads[g] for g in part} and len(part) == HEADS // tp
            assert part_aux == aux_sha
    kv_full[2][5 * PAGE + 1, 3, 0] += 1  # one value of head 3 in a page of the request
    (_, changed), = _server(1, kv_full, aux)
    after, _ = head_digests(changed, pages, 2)
    assert {g for g in heads if heads[g] != after[g]} == {3}


def test_a_rank_holding_another_head_count_than_its_tp_share_is_refused(full) -> None:
    kv_full, aux = full
    kv = [t[:, :1].contiguous() for t in kv_full]
    args = SimpleNamespace(kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.nbytes for t in kv],
                           kv_item_lens=[t[:PAGE].nbytes for t in kv], aux_data_ptrs=[aux.data_ptr()],
                           aux_data_lens=[aux.nbytes], aux_item_lens=[aux[0].nbytes], page_size=PAGE,
                           state_types=[], kv_head_num=1, total_kv_head_num=HEADS)
    with pytest.raises(LayoutError, match="holds 1 of 4 KV heads"):
        buffers.from_kv_args(args, "cpu", tp=2, rank=0)
    assert buffers.from_kv_args(args, "cpu", tp=4, rank=1).heads == buffers.Heads(count=1, total=4, first=1)
    assert buffers.from_kv_args(args, "cpu", tp=2, rank=0, mla=True).shards() == {}


def _params(rank: int, *, blocks=((3, 4), (9,)), request="sglang-7") -> wire.TransferParams:
    return wire.TransferParams(engine_id="sglang-producer-h:1", host="127.0.0.1", port=7000 + rank,
                               request_id=request, block_ids=[list(b) for b in blocks], num_tokens=2,
                               lease_expiry=2e9 + rank, incarnation=f"inc{rank}")


def test_a_decode_rank_loads_once_every_prefill_rank_sent_params_in_rank_order() -> None:
    gather = RankParams(max_age_s=60)
    assert gather.add(5, 1, _params(1), 2) is None and len(gather) == 1
    got = gather.add(5, 0, _params(0), 2)
    assert not got.error and len(gather) == 0
    assert [(r.port, r.incarnation) for r in got.params.ranks] == [(7000, "inc0"), (7001, "inc1")]
    assert got.params.lease_expiry == 2e9  # the soonest of the ranks' leases
    one = gather.add(6, 0, _params(0), 1)
    assert one.params.ranks == () and one.params.port == 7000


@pytest.mark.parametrize("second, why", [
    ((1, _params(1)), "sent params twice"),
    ((2, _params(2)), "prefill rank 2, the prefill runs 2"),
    ((0, _params(0, blocks=((3, 5), (9,)))), "do not agree"),
    ((0, _params(0, request="sglang-8")), "do not agree"),
])
def test_params_that_cannot_be_one_load_fail_the_room(second, why) -> None:
    gather = RankParams(max_age_s=60)
    assert gather.add(5, 1, _params(1), 2) is None
    got = gather.add(5, *second, 2)
    assert got.params is None and why in got.error
    assert len(gather) == 0  # the room is gone: a later frame starts over, it never joins a failed one


def test_a_room_whose_ranks_never_all_arrive_is_forgotten_after_its_leases_ran_out() -> None:
    now = [100.0]
    gather = RankParams(max_age_s=30, clock=lambda: now[0])
    assert gather.add(1, 0, _params(0), 2) is None
    now[0] += 10
    assert gather.add(2, 0, _params(0), 2) is None
    now[0] += 25  # room 1 is 35 s old, room 2 25 s
    assert gather.add(3, 0, _params(0), 2) is None
    assert len(gather) == 2
    gather.drop(2)
    assert len(gather) == 1


def test_decode_pairs_any_attention_tp_sizes_but_no_pipeline_context_or_unsplit_pages() -> None:
    info = lambda tp, pp=1, cp=1: SimpleNamespace(attn_tp_size=tp, pp_size=pp, attn_cp_size=cp)  # noqa: E731
    assert unpaired(info(2), 1, split_by_head=True) == ""
    assert unpaired(info(1), 4, split_by_head=True) == ""
    assert unpaired(info(2), 2, split_by_head=False) == ""
    assert "equal TP sizes only" in unpaired(info(2), 1, split_by_head=False)
    assert "pipeline parallel 2" in unpaired(info(2, pp=2), 2, split_by_head=True)
    assert "context parallel 2" in unpaired(info(2, cp=2), 2, split_by_head=True)
