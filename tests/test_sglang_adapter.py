"""The engine-free parts of the SGLang adapter: its control frames refuse anything malformed, and SGLang's
buffer pointers become regions over exactly those bytes (the SGLang e2e runs the rest, `make e2e-sglang`)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvconnect import wire
from kvconnect.errors import LayoutError
from kvconnect.integrations.sglang import buffers, frames
from kvconnect.regions import RegionSet


def _params() -> wire.TransferParams:
    return wire.TransferParams(engine_id="p", host="127.0.0.1", port=5555, request_id="sglang-7",
                               block_ids=[[3, 4, 5], [9]], num_tokens=3, lease_expiry=2e9, incarnation="i")


def test_meta_and_params_frames_round_trip() -> None:
    m = frames.Meta(room=2**63 + 5, host="10.0.0.2", port=4000, required=2, prefix_len=0, dummy=False)
    assert frames.parse_meta(frames.meta(m)) == m
    room, rank, params = frames.parse_params(frames.params(7, 0, _params()))
    assert (room, rank, params) == (7, 0, _params())


@pytest.mark.parametrize("bad", [
    lambda f: f[:-1],                           # a frame missing
    lambda f: [*f[:1], b"-1", *f[2:]],          # a negative room
    lambda f: [*f[:1], str(2**64).encode(), *f[2:]],  # a room past 64 bits
    lambda f: [*f[:2], b"", *f[3:]],            # no host
    lambda f: [*f[:2], b"a b", *f[3:]],         # a host with a space
    lambda f: [*f[:3], b"70000", *f[4:]],       # a port out of range
    lambda f: [*f[:4], b"0", *f[5:]],           # no decode rank to wait for
    lambda f: [*f[:6], b"yes"],                 # a dummy flag that is neither 0 nor 1
    lambda f: [*f[:1], b"\xff", *f[2:]],        # not ASCII
])
def test_a_malformed_meta_frame_parses_to_none(bad) -> None:
    good = frames.meta(frames.Meta(room=1, host="h", port=1, required=1, prefix_len=0, dummy=False))
    assert frames.parse_meta(bad(good)) is None


@pytest.mark.parametrize("bad", [
    lambda f: f[:3],                            # no params
    lambda f: [*f[:3], f[3][:-2]],              # truncated params
    lambda f: [*f[:3], b"{}"],                  # params missing every field
    lambda f: [*f[:3], b"x" * (wire.MAX_TRANSFER_PARAMS_BYTES + 1)],  # over the byte limit
    lambda f: [f[0], b"room", *f[2:]],          # a room that is no number
])
def test_malformed_params_parse_to_none(bad) -> None:
    assert frames.parse_params(bad(frames.params(7, 0, _params()))) is None


def _kv_args(kv: list[torch.Tensor], aux: list[torch.Tensor], **kw) -> SimpleNamespace:
    return SimpleNamespace(kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.nbytes for t in kv],
                           kv_item_lens=[t[0].nbytes for t in kv], aux_data_ptrs=[t.data_ptr() for t in aux],
                           aux_data_lens=[t.nbytes for t in aux], aux_item_lens=[t[0].nbytes for t in aux],
                           page_size=kw.get("page_size", 1), state_types=kw.get("state_types", []),
                           kv_head_num=kw.get("heads", 1), total_kv_head_num=kw.get("total_heads", kw.get("heads", 1)))


def test_params_naming_a_host_the_bootstrap_did_not_name_are_foreign() -> None:
    two_ranks = wire.TransferParams(**{f: getattr(_params(), f) for f in _params().__struct_fields__ if f != "ranks"},
                                    ranks=(wire.RankAddr(host="127.0.0.1", port=5555, incarnation="i"),
                                           wire.RankAddr(host="10.0.0.9", port=5556, incarnation="i")))
    assert frames.foreign_hosts(_params(), {"127.0.0.1"}) == []
    assert frames.foreign_hosts(two_ranks, {"127.0.0.1", "10.0.0.9"}) == []
    assert frames.foreign_hosts(two_ranks, {"127.0.0.1"}) == ["10.0.0.9"]  # one rank elsewhere is enough
    assert frames.foreign_hosts(_params(), ()) == ["127.0.0.1"]  # a room nobody bootstrapped trusts no host


def test_sglang_buffers_become_regions_over_the_same_bytes() -> None:
    layers = [torch.randn(2, 33, 2, 8, dtype=torch.float16) for _ in range(3)]  # per layer [K|V, slots, heads, dim]
    kv = [t[0] for t in layers] + [t[1] for t in layers]  # SGLang: K of every layer, then V
    aux = [torch.randint(0, 99, (16, 16), dtype=torch.int32), torch.randn(16, 4, dtype=torch.float32)]
    held = buffers.from_kv_args(_kv_args(kv, aux, heads=2), "cpu")
    rs = RegionSet.from_kv_caches(held.tensors, layer_groups=[g.layers for g in held.groups])
    assert len(rs) == len(kv) + len(aux)
    assert [g.label for g in held.groups] == ["kv", "aux"]
    for region, src in zip(rs, kv + aux):
        assert (region.base_addr, region.num_blocks, region.block_bytes) == (src.data_ptr(), src.shape[0], src[0].nbytes)
    # A view, not a copy: a page written through SGLang's tensor reads back through kvconnect's.
    kv[4][7] = 3.0
    page = held.tensors["kv4"][7].numpy()
    assert np.array_equal(page, kv[4][7].contiguous().view(torch.uint8).reshape(-1).numpy())


def test_buffers_that_kvconnect_cannot_move_are_refused_by_name() -> None:
    kv, aux = [torch.zeros(4, 8)], [torch.zeros(4, 2)]
    with pytest.raises(LayoutError, match="host memory"):
        buffers.from_kv_args(_kv_args(kv, aux), "cuda")
    with pytest.raises(LayoutError, match="state buffers"):
        buffers.from_kv_args(_kv_args(kv, aux, state_types=["mamba"]), "cpu")
    bad = _kv_args(kv, aux)
    bad.kv_item_lens = [24]  # 128 bytes is no whole number of 24-byte pages
    with pytest.raises(LayoutError, match="whole number"):
        buffers.from_kv_args(bad, "cpu")


def test_a_page_digest_changes_with_any_byte_of_the_request_and_no_other() -> None:
    from kvconnect.integrations.sglang.digest import pages_digest

    def held():
        kv = [torch.zeros(9, 2, 4, dtype=torch.float16) for _ in range(4)]
        aux = [torch.zeros(5, 8, dtype=torch.int32)]
        return kv, aux, buffers.from_kv_args(_kv_args(kv, aux, heads=2), "cpu")

    (kv_a, aux_a, a), (kv_b, aux_b, b) = held(), held()
    pages = np.array([2, 5, 6])
    assert pages_digest(a, pages, 3) == pages_digest(b, pages, 3)
    kv_b[3][0, 1, 1] = 1.0  # a page the request does not use
    aux_b[0][4, 0] = 7  # an aux row of another request
    assert pages_digest(a, pages, 3) == pages_digest(b, pages, 3)
    kv_b[3][6, 1, 3] = 1.0  # its last page, in the last buffer
    assert pages_digest(a, pages, 3) != pages_digest(b, pages, 3)
    kv_b[3][6, 1, 3] = 0.0
    aux_b[0][3, 7] = 1  # its aux row
    assert pages_digest(a, pages, 3) != pages_digest(b, pages, 3)


@pytest.mark.parametrize("enabled, timeout_s, load_timeout_s, refused", [
    (True, 90.0, 60.0, None),
    (True, 60.0, 60.0, None),                 # SGLang's timer starts at the abort, after the load's deadline did
    (False, 90.0, 60.0, "_RELEASE is off"),   # pages handed on at once while a READ may land
    (True, 30.0, 60.0, "shorter than"),       # SGLang's default timeout under kvconnect's default deadline
    (True, float("nan"), 60.0, "shorter than"),
])
def test_decode_refuses_sglang_settings_that_free_pages_under_a_read(enabled, timeout_s, load_timeout_s,
                                                                       refused) -> None:
    from kvconnect.integrations.sglang.deferral import problem

    why = problem(enabled, timeout_s, load_timeout_s)
    assert (why is None) if refused is None else (refused in why), why


@pytest.mark.parametrize("configured_s, explicit, timeout_s, used_s", [
    (60.0, False, 30.0, 24.0),   # both defaults: the load ends well inside SGLang's 30 s
    (60.0, False, 90.0, 60.0),   # a long SGLang timeout leaves the default alone
    (60.0, True, 30.0, 60.0),    # the operator's own deadline is kept (and then refused: see above)
])
def test_decode_load_deadline_defaults_inside_sglangs_release_timeout(configured_s, explicit, timeout_s,
                                                                      used_s) -> None:
    from kvconnect.integrations.sglang.deferral import load_timeout, problem

    used = load_timeout(configured_s, explicit, timeout_s)
    assert used == pytest.approx(used_s)
    assert (problem(True, timeout_s, used) is None) == (used <= timeout_s)
