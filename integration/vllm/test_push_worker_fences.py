"""The push workers record a fence on the engine's compute stream at every point vLLM hands them KV,
and give it to the core with the regions it covers (the core's side: tests/test_push_fences.py).

A double stands in for `torch.cuda` (no GPU here): it logs which stream each event was recorded on.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvconnect.pd import fence as fences
from kvconnect.integrations.vllm.config import PDConfig
from kvconnect.integrations.vllm.meta import HoldOrder, KVConnectMeta
from kvconnect.integrations.vllm.push_worker import LayerwisePushWorker, PushWorker


class _Cuda:
    """torch.cuda as far as fences use it: events recorded on the current stream of a device."""

    def __init__(self, log: list):
        self.log = log
        cuda = self

        class Event:
            def record(self, stream) -> None:
                cuda.log.append(("record", stream))

            def query(self) -> bool:
                return True

        self.Event = Event

    def current_stream(self, device):
        return f"stream of {device}"


class _PushRole:
    def __init__(self, log: list):
        self.log = log

    def push(self, key, block_ids, *, handle, layerwise, fence):
        self.log.append(("push", handle, layerwise, fence))

    def layers_saved(self, names, fence):
        self.log.append(("layers_saved", tuple(names), fence))
        return 1

    def forward_done(self, fence):
        self.log.append(("forward_done", fence))


def _worker(kind, log, monkeypatch):
    monkeypatch.setattr(fences.torch, "cuda", _Cuda(log))
    worker = kind(PDConfig(mode="push"), engine_id="p", role="producer", backend="nixl", block_size=16,
                  layout="LBHNC", groups=())
    worker.core = SimpleNamespace(push_role=_PushRole(log))
    worker.device = torch.device("cuda", 1)
    return worker


def test_a_whole_prompt_push_carries_a_fence_recorded_after_the_pass_was_queued(monkeypatch) -> None:
    log: list = []
    worker = _worker(PushWorker, log, monkeypatch)
    worker._hold(HoldOrder(request_id="r", block_ids=[[1, 2]], num_tokens=32, push_key="k"))
    (record, stream), (push, handle, layerwise, fence) = log
    assert (record, stream, push, handle, layerwise) == ("record", "stream of cuda:1", "push", "r", False)
    assert fence is not None and fence.query()


def test_a_layerwise_push_gives_each_saved_layer_and_the_pass_end_their_own_fence(monkeypatch) -> None:
    log: list = []
    worker = _worker(LayerwisePushWorker, log, monkeypatch)
    meta = KVConnectMeta(holds=[HoldOrder(request_id="r", block_ids=[[1]], num_tokens=16, push_key="k")])
    worker.layer_saved("l0", meta)
    worker.layer_saved("l1", meta)
    worker.after_forward(meta)
    kinds = [entry[0] for entry in log]
    assert kinds == ["push", "record", "layers_saved", "record", "layers_saved", "record", "forward_done"], kinds
    fenced = [entry[-1] for entry in log if entry[0] in ("layers_saved", "forward_done")]
    assert all(f is not None for f in fenced) and len({id(f) for f in fenced}) == 3


def test_on_cpu_there_is_no_fence() -> None:
    assert fences.stream_fence(torch.device("cpu")) is None and fences.stream_fence(None) is None
