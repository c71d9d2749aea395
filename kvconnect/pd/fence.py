"""Fences on an engine's compute stream, so that a push never writes bytes a kernel has not finished.

vLLM, for one, calls `save_kv_layer` when a layer's kernels are queued on the GPU, and `wait_for_save`
when the whole pass is queued; neither means the kernels ran, and a WRITE posted then could carry
stale bytes. So push mode records a fence on the current stream at each of those points and hands it
to the core, whose peer worker posts the covered regions only once the fence is passed: the forward
pass never waits, and the WRITE never overtakes the compute. On CPU the forward pass runs
synchronously, so there is no fence (None: the bytes are final now).

A `Fence` is anything with a non-blocking `query()`; `stream_fence` makes one from torch's current
CUDA stream. The core never waits on one: the peer worker polls it with its transfers.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Fence(Protocol):
    """Marks the point of an engine's compute stream after which a load's bytes are final (a CUDA event)."""

    def query(self) -> bool:
        """True once everything queued on the stream before the fence has completed; never blocks."""


def stream_fence(device: torch.device | None) -> Fence | None:
    """An event recorded now on `device`'s current stream (None on CPU: nothing is queued there)."""
    if device is None or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
