"""Push from a GPU never writes bytes the engine's kernels have not finished.

vLLM hands kvconnect a layer (and, at `wait_for_save`, the whole pass) when its kernels are queued,
not finished. The engine adapter records a fence on the compute stream at those points, and a WRITE
is posted only once its fence is passed, without the forward pass waiting. Here a stream double
stands in for the GPU: its queued "kernels" really write the prefill's blocks when the stream runs,
so a WRITE posted too early would carry the old bytes. Both connectors move real bytes over the
real transport; the order of recording, computing and posting is logged and checked.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import byte_rows, real_transport, wait_for
from kvconnect.faults import FaultyTransport

pytestmark = pytest.mark.timeout(120)


class Stream:
    """An in-order compute stream: queued kernels run only when the test says, events complete behind them."""

    def __init__(self, log: list[str]):
        self.log = log
        self.queue: list = []
        self.done = 0

    def launch(self, name: str, kernel) -> None:
        self.queue.append((name, kernel))

    def record(self) -> Event:
        event = Event(self, len(self.queue))
        self.log.append(f"record@{event.position}")
        return event

    def run(self, steps: int | None = None) -> None:
        """Run the next `steps` queued kernels (all of them by default)."""
        stop = len(self.queue) if steps is None else min(len(self.queue), self.done + steps)
        while self.done < stop:
            name, kernel = self.queue[self.done]
            kernel()
            self.done += 1
            self.log.append(f"ran {name}")


class Event:
    """A CUDA event double: passed once every kernel queued before it ran."""

    def __init__(self, stream: Stream, position: int):
        self.stream, self.position = stream, position

    def query(self) -> bool:
        return self.stream.done >= self.position


class Recording(FaultyTransport):
    """The real transport, logging each post with the regions it moves (nothing injected)."""

    log: list[str] = []

    def post(self, op, peer_id, *args, **kw):
        self.log.append(f"post {sorted(op.regions.tolist())}")
        return super().post(op, peer_id, *args, **kw)


def _pair(consumers, backend, log):
    decode, dcaches = consumers("dense", 32, push=True, engine_id="decode-0")
    transport = Recording(real_transport(backend))
    transport.log = log
    prefill, pcaches = consumers("dense", 32, push=True, engine_id="prefill-0", transport=transport)
    return decode, dcaches, prefill, pcaches


def _kernel(rows: torch.Tensor, blocks: list[int], value: int):
    def run() -> None:
        rows[blocks] = value  # the "GPU" writing this layer's KV for the prompt
    return run


def _fresh(log: list[str]) -> list[str]:
    return [line for line in log if line.startswith(("ran", "post", "record"))]


def test_a_whole_prompt_push_is_posted_only_after_the_stream_passed_its_fence(consumers, backend) -> None:
    log: list[str] = []
    decode, dcaches, prefill, pcaches = _pair(consumers, backend, log)
    stream = Stream(log)
    for k, rows in enumerate(byte_rows(pcaches, prefill)):
        stream.launch(f"layer{k}", _kernel(rows, [3, 4], 100 + k))
    fence = stream.record()  # wait_for_save: the whole pass is queued, none of it ran
    decode.expect_push("k", (prefill.side_channel[0], prefill.side_channel[1]), [[5, 6]], 32, handle="r")
    prefill.push("k", [[3, 4]], handle="p", fence=fence)
    time.sleep(0.5)  # time enough to claim and post, were the fence not honoured
    assert not [line for line in log if line.startswith("post")], log
    assert not decode.get_finished().loaded
    stream.run()
    assert wait_for(decode, ["r"]).loaded == ["r"]
    order = _fresh(log)
    assert order.index(f"ran layer{len(prefill.regions) - 1}") < order.index(next(x for x in order if x.startswith("post")))
    for src, dst in zip(byte_rows(pcaches, prefill), byte_rows(dcaches, decode)):
        assert torch.equal(dst[[5, 6]], src[[3, 4]]) and int(src[3, 0]) >= 100


def test_a_layerwise_push_posts_each_layer_only_after_its_kernel_ran(consumers, backend) -> None:
    log: list[str] = []
    decode, dcaches, prefill, pcaches = _pair(consumers, backend, log)
    stream = Stream(log)
    decode.expect_push("k", (prefill.side_channel[0], prefill.side_channel[1]), [[5, 6]], 32, handle="r")
    prefill.push("k", [[3, 4]], handle="p", layerwise=True)
    rows = byte_rows(pcaches, prefill)
    for k, region in enumerate(prefill.regions):
        stream.launch(f"layer{k}", _kernel(rows[k], [3, 4], 100 + k))
        prefill.layers_saved(region.names, stream.record())
    prefill.forward_done(stream.record())
    time.sleep(0.5)
    assert not [line for line in log if line.startswith("post")], log
    for _ in prefill.regions:  # the stream runs one layer at a time; each post follows its own kernel
        stream.run(1)
        time.sleep(0.1)
    assert wait_for(decode, ["r"]).loaded == ["r"]
    order = _fresh(log)
    for line in [x for x in order if x.startswith("post")]:
        for k in eval(line.removeprefix("post ")):
            assert order.index(f"ran layer{k}") < order.index(line), order
    for src, dst in zip(byte_rows(pcaches, prefill), byte_rows(dcaches, decode)):
        assert torch.equal(dst[[5, 6]], src[[3, 4]])


def test_a_stream_that_fails_fails_the_push_instead_of_posting(consumers, backend) -> None:
    log: list[str] = []
    decode, _, prefill, _ = _pair(consumers, backend, log)

    class Broken:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    decode.expect_push("k", (prefill.side_channel[0], prefill.side_channel[1]), [[5]], 16, handle="r", timeout_s=5.0)
    prefill.push("k", [[3]], handle="p", fence=Broken())
    fin = wait_for(decode, ["r"], timeout=20)
    assert "r" in fin.failed and not [line for line in log if line.startswith("post")], (fin, log)
