"""The vLLM adapter's pull and push schedulers, driven by hand: params parsed once, carried as the struct,
refused where they do not belong, and the worker orders each mode gives.

Runs in `make e2e` (it needs vLLM), without an engine.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from vllm.v1.request import RequestStatus

from kvconnect import wire
from kvconnect.integrations.vllm import params as vparams
from kvconnect.integrations.vllm.config import PDConfig
from kvconnect.integrations.vllm.groups import GroupRule, Groups
from kvconnect.integrations.vllm.meta import KVConnectHandshake, LoadOrder
from kvconnect.integrations.vllm.pull_scheduler import PullScheduler
from kvconnect.integrations.vllm.push_scheduler import PushScheduler
from kvconnect.kvgroups import KVGroup

GROUPS = Groups((KVGroup(layers=("l0",)),), (GroupRule(block_size=16),), (0,))


def _scheduler(kind, monkeypatch):
    monkeypatch.setattr("kvconnect.integrations.vllm.pull_scheduler.LeaseKeeper", _Keeper)
    s = kind(PDConfig(mode=kind.mode), engine_id="me", groups=GROUPS, blocks_of=lambda rid: ([7, 8, 9],))
    s.set_handshake({0: KVConnectHandshake(engine_id="me", host="127.0.0.1", port=5600, incarnation="i")})
    return s


class _Keeper:
    def __init__(self, **kw):
        self.tracked_ids = []

    def track(self, params):
        self.tracked_ids.append(params.request_id)

    def untrack(self, rid):
        self.tracked_ids = [r for r in self.tracked_ids if r != rid]

    tracked = property(lambda self: len(self.tracked_ids))

    def close(self):
        pass


def _request(rid, params, tokens=40):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(tokens)),
                           _all_token_ids=list(range(tokens)), num_prompt_tokens=tokens, num_computed_tokens=0,
                           max_tokens=16, status=RequestStatus.RUNNING)


def _blocks(ids):
    return SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: (list(ids),))


def _pull_params(rid="p1", tokens=40):
    p = wire.TransferParams(engine_id="prefill", host="127.0.0.1", port=5500, request_id=rid,
                            block_ids=[[1, 2, 3]], num_tokens=tokens, lease_expiry=1e10, incarnation="x")
    return vparams.to_vllm(p)


@pytest.mark.parametrize("kind", [PullScheduler, PushScheduler])
def test_pull_params_are_parsed_once_and_reach_the_worker_as_the_struct(kind, monkeypatch) -> None:
    s = _scheduler(kind, monkeypatch)
    calls = []
    real = vparams.from_vllm
    monkeypatch.setattr("kvconnect.integrations.vllm.pull_scheduler.from_vllm",
                        lambda d: calls.append(1) or real(d))
    req = _request("d1", _pull_params())
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    s.update_state_after_alloc(req, _blocks([4, 5, 6]), 40)
    meta = s.build_meta({})
    assert calls == [1]
    (load,) = meta.loads
    assert isinstance(load.params, wire.TransferParams) and load.params.request_id == "p1"
    assert load.block_ids == [[4, 5, 6]]
    assert pickle.loads(pickle.dumps(meta)).loads == [load]  # what vLLM sends the workers


def test_params_refused_at_parsing_still_make_a_load_the_worker_fails(monkeypatch) -> None:
    s = _scheduler(PullScheduler, monkeypatch)
    bad = {**_pull_params(), "remote_port": "not a port"}
    req = _request("d2", bad)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    s.update_state_after_alloc(req, _blocks([4, 5, 6]), 40)
    meta = s.build_meta({})
    assert not meta.loads and [r.request_id for r in meta.refused] == ["d2"]
    assert "malformed transfer parameters" in meta.refused[0].reason


def test_a_pull_instance_refuses_push_params_and_computes_the_request(monkeypatch, caplog) -> None:
    s = _scheduler(PullScheduler, monkeypatch)
    req = _request("d3", {"do_remote_prefill": True, "push_key": "k", "remote_host": "h", "remote_port": 1})
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "stage=params" in caplog.text and "mode 'pull'" in caplog.text


def test_a_pull_prefill_holds_a_push_routed_prompt_for_a_pull(monkeypatch, caplog) -> None:
    s = _scheduler(PullScheduler, monkeypatch)
    req = _request("p", {"do_remote_decode": True, "push_key": "k"})
    s.on_new_request(req)
    s.update_state_after_alloc(req, _blocks([7, 8, 9]), 0)
    (hold,) = s.build_meta({"p": 40}).holds
    assert hold.push_key == "" and "stage=params" in caplog.text
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    keep, params = s.request_finished(req)
    assert keep and params["remote_request_id"] == "p" and params["remote_block_ids"] == [7, 8, 9]


def test_a_push_instance_offers_and_writes_instead_of_handing_out(monkeypatch) -> None:
    s = _scheduler(PushScheduler, monkeypatch)
    decode = _request("d", {"do_remote_prefill": True, "push_key": "k", "remote_host": "h", "remote_port": 9})
    s.on_new_request(decode)
    assert s.get_num_new_matched_tokens(decode, 0) == (40, True)
    s.update_state_after_alloc(decode, _blocks([4, 5, 6]), 40)
    prefill = _request("p", {"do_remote_decode": True, "push_key": "k"})
    s.on_new_request(prefill)
    s.update_state_after_alloc(prefill, _blocks([7, 8, 9]), 0)
    meta = s.build_meta({"p": 40})
    assert [(o.key, o.host, o.port, o.block_ids) for o in meta.offers] == [("k", "h", 9, [[4, 5, 6]])]
    assert [h.push_key for h in meta.holds] == ["k"]
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(prefill) == (True, None)


def test_malformed_push_params_are_refused_on_a_push_instance(monkeypatch, caplog) -> None:
    s = _scheduler(PushScheduler, monkeypatch)
    req = _request("d", {"do_remote_prefill": True, "push_key": "", "remote_host": "h", "remote_port": 9})
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "stage=params" in caplog.text


def test_a_decode_aborted_in_the_queue_releases_the_producer(monkeypatch) -> None:
    s = _scheduler(PullScheduler, monkeypatch)
    req = _request("d", _pull_params("p9"))
    s.on_new_request(req)
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req) == (False, None)
    (release,) = s.build_meta({}).releases
    assert release.params.request_id == "p9" and s.stats()["kept_alive"] == 0


def test_a_decode_requests_load_deadline_is_read_at_the_edge_and_capped_at_load_timeout_s() -> None:
    d = {"do_remote_prefill": True}
    assert vparams.load_timeout(d, 60.0) is None and vparams.load_timeout(None, 60.0) is None
    assert vparams.load_timeout({**d, "kvconnect_load_timeout_s": 20}, 60.0) == 20.0
    assert vparams.load_timeout({**d, "kvconnect_load_timeout_s": 600}, 60.0) == 60.0  # capped, not refused
    for bad in ("20", True, None, float("nan"), float("inf"), 0, -5):
        with pytest.raises(wire.WireError, match="kvconnect_load_timeout_s must be a positive, finite number"):
            vparams.load_timeout({**d, "kvconnect_load_timeout_s": bad}, 60.0)


@pytest.mark.parametrize("kind", [PullScheduler, PushScheduler])
@pytest.mark.parametrize(("given", "want"), [(None, None), (20, 20.0), (600.0, 60.0)],
                         ids=["none", "shorter", "longer"])
def test_a_routers_load_deadline_reaches_the_load_order_capped(kind, given, want, monkeypatch) -> None:
    s = _scheduler(kind, monkeypatch)
    extra = {} if given is None else {"kvconnect_load_timeout_s": given}
    req = _request("d1", {**_pull_params(), **extra})
    s.on_new_request(req)
    s.update_state_after_alloc(req, _blocks([4, 5, 6]), 40)
    (load,) = s.build_meta({}).loads
    assert load.timeout_s == want and s.config.load_timeout_s == 60.0
    s.update_connector_output(SimpleNamespace(finished_recving={"d1"}, finished_sending=None, kv_connector_stats=None))
    assert s._timeouts == {}  # forgotten with the load


def test_a_malformed_load_deadline_refuses_the_pull_and_frees_the_producer_at_once(monkeypatch) -> None:
    s = _scheduler(PullScheduler, monkeypatch)
    req = _request("d2", {**_pull_params("p2"), "kvconnect_load_timeout_s": "soon"})
    s.on_new_request(req)
    assert s.stats()["kept_alive"] == 0
    s.update_state_after_alloc(req, _blocks([4, 5, 6]), 40)
    meta = s.build_meta({})
    assert not meta.loads and [r.request_id for r in meta.refused] == ["d2"]
    assert "kvconnect_load_timeout_s" in meta.refused[0].reason
    assert [r.params.request_id for r in meta.releases] == ["p2"]


def test_a_push_offer_carries_the_routers_load_deadline_and_a_malformed_one_computes_the_request(
        monkeypatch, caplog) -> None:
    s = _scheduler(PushScheduler, monkeypatch)
    push = {"do_remote_prefill": True, "push_key": "k", "remote_host": "h", "remote_port": 9}
    for rid, extra in (("a", {}), ("b", {"kvconnect_load_timeout_s": 25}), ("c", {"kvconnect_load_timeout_s": 1e9})):
        req = _request(rid, {**push, "push_key": rid, **extra})
        s.on_new_request(req)
        s.update_state_after_alloc(req, _blocks([4, 5, 6]), 40)
    assert [(o.request_id, o.timeout_s) for o in s.build_meta({}).offers] == [("a", None), ("b", 25.0), ("c", 60.0)]
    bad = _request("d", {**push, "kvconnect_load_timeout_s": float("nan")})
    s.on_new_request(bad)
    assert s.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert "stage=params" in caplog.text and "kvconnect_load_timeout_s" in caplog.text


def test_the_old_meta_names_say_their_new_ones() -> None:
    from kvconnect.integrations.vllm import meta

    with pytest.raises(AttributeError, match="LoadOrder"):
        meta.Load  # noqa: B018
    assert LoadOrder.__struct_fields__ == ("request_id", "block_ids", "params", "timeout_s")


class _Core:
    """What a worker calls on kvconnect's core, recorded; `fail` names the calls that raise."""

    def __init__(self, fail=()):
        from kvconnect.connector import Finished

        self.calls, self.fail, self.finished = [], set(fail), Finished()
        self.timeouts = {}  # handle -> the timeout_s a load or offer was started with
        self.push_role = self

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if name in self.fail:
            from kvconnect.errors import BlockRangeError

            raise BlockRangeError(f"{name} refused")

    def start_load(self, params, ids, handle, timeout_s=None, decoded=False):
        self.timeouts[handle] = timeout_s
        self._call("start_load", params, handle)

    def release_remote(self, params, decoded=False):
        self._call("release_remote", params.request_id)

    def hold_blocks(self, rid, ids, ntok):
        self._call("hold", rid)

    def expect(self, key, addr, ids, ntok, handle, timeout_s=None):
        self.timeouts[handle] = timeout_s
        self._call("expect", key, handle)

    def push(self, key, ids, handle, layerwise=False, fence=None):
        self._call("push", key, handle, layerwise)

    def abort(self, rid):
        self._call("abort", rid)

    def get_finished(self):
        return self.finished


def _worker(kind, core):
    w = kind(PDConfig(mode="pull" if kind.__name__ == "PullWorker" else "push"), engine_id="me", role="both",
             backend="nixl", block_size=16, layout="LBHNC", groups=[])
    w.core = core
    return w


def test_a_refused_load_and_a_load_the_core_refuses_are_reported_failed() -> None:
    from kvconnect.integrations.vllm.meta import KVConnectMeta, RefusedLoad
    from kvconnect.integrations.vllm.pull_worker import PullWorker

    core = _Core(fail={"start_load"})
    w = _worker(PullWorker, core)
    params = vparams.from_vllm(_pull_params("p1"))
    w.start(KVConnectMeta(loads=[LoadOrder(request_id="a", block_ids=[[1]], params=params)],
                          refused=[RefusedLoad(request_id="b", reason="malformed")]))
    assert core.calls[0] == ("start_load", params, "a")  # the struct as the scheduler sent it
    assert ("release_remote", "p1") in core.calls
    out = w.results()
    assert out.finished_recving == {"a", "b"} and out.failed_recving == {"a", "b"}


def test_the_workers_start_loads_and_offers_with_the_deadline_the_scheduler_ordered() -> None:
    from kvconnect.integrations.vllm.meta import KVConnectMeta, OfferOrder
    from kvconnect.integrations.vllm.push_worker import PushWorker

    core = _Core()
    w = _worker(PushWorker, core)
    params = vparams.from_vllm(_pull_params("p1"))
    w.start(KVConnectMeta(loads=[LoadOrder(request_id="a", block_ids=[[1]], params=params, timeout_s=5.0),
                                 LoadOrder(request_id="b", block_ids=[[2]], params=params)],
                          offers=[OfferOrder(request_id="c", block_ids=[[3]], num_tokens=16, key="k", host="h", port=9,
                                             timeout_s=7.0)]))
    assert core.timeouts == {"a": 5.0, "b": None, "c": 7.0}  # None: the core's load_timeout_s


def test_the_mode_picks_the_roles_once() -> None:
    from kvconnect.integrations.vllm.connectors import _roles
    from kvconnect.integrations.vllm.pull_worker import PullWorker
    from kvconnect.integrations.vllm.push_worker import LayerwisePushWorker, PushWorker

    assert _roles(PDConfig()) == (PullScheduler, PullWorker)
    assert _roles(PDConfig(mode="push")) == (PushScheduler, PushWorker)
    assert _roles(PDConfig(mode="push", layerwise=True)) == (PushScheduler, LayerwisePushWorker)


def test_a_push_worker_writes_pushed_holds_and_holds_the_others() -> None:
    from kvconnect.integrations.vllm.meta import HoldOrder, KVConnectMeta, OfferOrder
    from kvconnect.integrations.vllm.push_worker import PushWorker

    core = _Core(fail={"expect"})
    w = _worker(PushWorker, core)
    w.start(KVConnectMeta(offers=[OfferOrder(request_id="d", block_ids=[[1]], num_tokens=16, key="k",
                                             host="h", port=9)]))
    w.after_forward(KVConnectMeta(holds=[HoldOrder(request_id="p", block_ids=[[2]], num_tokens=16, push_key="k2"),
                                         HoldOrder(request_id="q", block_ids=[[3]], num_tokens=16)]))
    assert ("push", "k2", "p", False) in core.calls and ("hold", "q") in core.calls
    assert w.results().failed_recving == {"d"}  # the offer the core refused



def test_the_stats_file_shows_the_workers_leases_held_now_not_a_sum_of_steps(monkeypatch) -> None:
    """Workers report the gauge as each process's current value; the scheduler shows their latest values' sum."""
    from kvconnect.integrations.vllm.stats import KVConnectStats

    s = _scheduler(PullScheduler, monkeypatch)

    def step(**data):
        s.update_connector_output(SimpleNamespace(finished_recving=None, finished_sending=None,
                                                  kv_connector_stats=KVConnectStats(data=data)))
        return s.stats()

    assert step(**{"kvconnect_leases_held@h:1": 2.0, "loads_ok": 1})["worker_leases_held"] == 2
    assert step(**{"kvconnect_leases_held@h:2": 1.0})["worker_leases_held"] == 3  # another rank's process
    got = step(**{"kvconnect_leases_held@h:1": 0.0, "loads_ok": 2})
    assert got["worker_leases_held"] == 1 and got["loads_ok"] == 3
    assert step()["worker_leases_held"] == 1  # a step with nothing changed keeps the last values
