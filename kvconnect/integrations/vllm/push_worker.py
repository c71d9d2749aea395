"""Push mode, worker side: offer a decode's blocks, write a prefill's into them.

Decode: the scheduler's `OfferOrder`s go to the core's push role, which holds the blocks and offers
them to the prefill; the WRITE that lands is reported as a load. Prefill: a held prompt with a push
key is written, not held for a read; vLLM waits for the WRITE's end to free its blocks (reported as
sent, even when the push failed: nothing reads them any more). Layer-wise (`LayerwisePushWorker`):
the pushes of the prompts a forward pass completes begin at its first computed layer, and each layer
is written as soon as it is computed. A push instance serves pull-routed requests too.
"""

from __future__ import annotations

import logging

from kvconnect.connector import Finished
from kvconnect.errors import KVConnectError
from kvconnect.integrations.vllm.meta import HoldOrder, KVConnectMeta, OfferOrder
from kvconnect.integrations.vllm.pull_worker import PullWorker
from kvconnect.pd.failure import LoadFailure, Stage
from kvconnect.pd.fence import stream_fence

log = logging.getLogger("kvconnect.vllm")


class PushWorker(PullWorker):
    """Offers blocks (decode) and writes held prompts into offered ones (prefill); reads as pull does."""

    push = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._unpushed: list[str] = []  # pushes refused at start: their blocks are free at the next results
        self._pushed: set[str] = set()  # held to be written into a decode's blocks: vLLM waits for the end

    def _start_transfers(self, meta: KVConnectMeta) -> None:
        super()._start_transfers(meta)
        for offer in meta.offers:
            self._offer(offer)

    def _offer(self, offer: OfferOrder) -> None:
        log.debug("kvconnect: offer %s (push %s) to %s:%s", offer.request_id, offer.key, offer.host, offer.port)
        try:
            prefill = (offer.host, offer.port, offer.tp_size)
            self.core.push_role.expect(offer.key, prefill, offer.block_ids, offer.num_tokens,
                                       handle=offer.request_id, timeout_s=offer.timeout_s)
        except KVConnectError as exc:
            self._refuse(offer.request_id, LoadFailure.of(Stage.OFFER, exc), f"{offer.host}:{offer.port}")
            return
        if self._dump is not None:  # named by the push key, as the prefill's dump is
            self._loading[offer.request_id] = (offer.key, offer.block_ids)

    def _hold(self, hold: HoldOrder) -> None:
        if not hold.push_key:
            super()._hold(hold)
            return
        self._pushed.add(hold.request_id)
        self._push(hold)

    def _push(self, hold: HoldOrder, layerwise: bool = False) -> None:
        # Whole prompt: after the pass is queued, so the WRITE waits for its kernels; layer-wise: each
        # layer brings its own fence, and nothing is posted before the first.
        fence = None if layerwise else stream_fence(self.device)
        try:
            self.core.push_role.push(hold.push_key, hold.block_ids, handle=hold.request_id, layerwise=layerwise,
                                     fence=fence)
        except KVConnectError as exc:  # the blocks are reported sent (free) at the next results
            log.warning("kvconnect push failed: request=%s stage=%s reason=%s", hold.request_id, Stage.PARAMS, exc)
            self._unpushed.append(hold.request_id)

    def _abandons(self, rid: str) -> bool:
        return super()._abandons(rid) and rid not in self._pushed

    def _sent(self, fin: Finished) -> list[str]:
        for rid, why in fin.push_failed.items():
            log.warning("kvconnect push failed: request=%s stage=%s reason=%s", rid, Stage.TRANSFER, why)
        sent = fin.sending + self._unpushed
        self._unpushed = []
        self._pushed.difference_update(sent)
        return sent


class LayerwisePushWorker(PushWorker):
    """A push worker that writes each layer's KV while the forward pass computes the next."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._streamed: set[str] = set()  # layer-wise pushes of the forward pass that runs
        self._stream_meta: KVConnectMeta | None = None  # the step whose pushes began

    def layer_saved(self, layer_name: str, meta: KVConnectMeta | None) -> None:
        """The running pass computed this layer's KV; write it for the prompts the pass completes.

        vLLM starts a step's loads after its forward pass, so the pushes of the prompts this pass
        completes begin at its first computed layer.
        """
        if meta is None:
            return
        if meta is not self._stream_meta:
            self._stream_meta = meta
            for hold in meta.holds:
                if hold.push_key:
                    self._pushed.add(hold.request_id)
                    self._held.add(hold.request_id)
                    self._streamed.add(hold.request_id)
                    self._push(hold, layerwise=True)
        if self._streamed:
            sent = self.core.push_role.layers_saved((layer_name,), stream_fence(self.device))
            log.debug("kvconnect: layer %s computed, to %d running WRITE(s)", layer_name, sent)
            self._stats.add(layers_streamed=sent)

    def _hold(self, hold: HoldOrder) -> None:
        if hold.request_id not in self._streamed:  # else pushed before the pass, layer by layer
            super()._hold(hold)

    def _pass_ended(self) -> None:
        if self._streamed:
            self._streamed.clear()
            self.core.push_role.forward_done(stream_fence(self.device))
