"""The worker-side half of KVConnectNixl and KVConnectMooncake: does what the scheduler decided.

Holds blocks right after the forward pass that computed a prompt's end (`wait_for_save`), starts and
aborts pulls before the next one (`start_load_kv`), and reports what ended: sends whose blocks vLLM
may free, loads that finished, loads that failed (in `finished_recving` and `failed_recving` both,
only once nothing can still land in their blocks, so vLLM never reuses a block under a READ).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvconnect.connector import ConnectorConfig, KVConnector, KVGroup
from kvconnect.errors import KVConnectError
from kvconnect.integrations.vllm.config import PDConfig
from kvconnect.integrations.vllm.dump import PageDump
from kvconnect.integrations.vllm.meta import Hold, KVConnectHandshake, KVConnectMeta, Offer
from kvconnect.integrations.vllm.params import from_vllm
from kvconnect.integrations.vllm.stats import KVConnectStats, StepStats
from kvconnect.shards import PageShards

log = logging.getLogger("kvconnect.vllm")


class PDWorker:
    """One engine worker's kvconnect core, driven by the scheduler's per-step instructions."""

    def __init__(self, config: PDConfig, *, engine_id: str, role: str, backend: str, block_size: int,
                 layout: str, groups: Sequence[KVGroup], rank: int = 0, world_size: int = 1,
                 shards_of: Callable[[dict[str, torch.Tensor]], dict[str, PageShards]] | None = None):
        self._shards_of = shards_of
        # Each TP rank is one worker with its own side channel: rank r listens on port + r.
        self.core_config = ConnectorConfig(
            engine_id=engine_id, role=role, backend=backend, host=config.host,
            port=config.port + rank if config.port else 0, rank=rank, world_size=world_size,
            advertise_host=config.advertise_host, allow_wildcard=config.allow_wildcard, secret=config.secret,
            lease_s=config.lease_s, load_timeout_s=config.load_timeout_s,
            handshake_timeout_s=config.handshake_timeout_s, heartbeat_s=config.heartbeat_s, block_size=block_size,
            layout=layout, groups=list(groups) or None, transport_options=dict(config.transport_options),
            push=config.mode == "push")
        self.core: KVConnector | None = None
        self._dump: PageDump | None = None
        self._loading: dict[str, tuple[str, list[list[int]]]] = {}  # handle -> producer request, blocks (dump only)
        self._held: set[str] = set()  # requests this worker holds blocks for
        self._abandoned: set[str] = set()  # held, but vLLM freed the blocks itself: never report as sent
        self._refused: dict[str, str] = {}  # loads refused at start, reported at the next results
        self._unpushed: list[str] = []
        self._pushed: set[str] = set()  # held to be written into a decode's blocks: vLLM waits for the end
        self._layerwise = config.layerwise and config.mode == "push"
        self._streamed: set[str] = set()  # layer-wise pushes of the forward pass that runs
        self._stream_meta: KVConnectMeta | None = None  # the step whose pushes began  # pushes refused at start: their blocks are free at the next results
        self._stats = StepStats(with_metrics=True)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the engine's KV tensors with a new core (transport, side channel, consumer)."""
        cfg = self.core_config
        if self._shards_of is not None:
            cfg = self.core_config = dataclasses.replace(cfg, shards=self._shards_of(kv_caches) or None)
        core = KVConnector(cfg)
        core.register_kv_caches(kv_caches)
        self.core = core
        self._dump = PageDump.from_env(kv_caches, cfg.groups or (), cfg.rank if cfg.world_size > 1 else None)

    def handshake(self) -> KVConnectHandshake | None:
        """Where this worker's producer side channel listens (None without a producer side)."""
        if self.core is None or self.core.producer is None:
            return None
        host, port = self.core.side_channel
        return KVConnectHandshake(engine_id=self.core_config.engine_id, host=host, port=port,
                                  incarnation=self.core.metadata.incarnation)

    def start(self, meta: KVConnectMeta) -> None:
        """Before the forward pass: start this step's pulls, send its releases, then its aborts."""
        core = self.core
        for load in meta.loads:
            log.debug("kvconnect: load %s", load.request_id)
            params = None
            try:
                params = from_vllm(load.params)
                core.start_load(params, load.block_ids, handle=load.request_id)
                if self._dump is not None:
                    self._loading[load.request_id] = (params.request_id, load.block_ids)
            except KVConnectError as exc:  # bad params or ids: the request fails as the policy says
                log.warning("kvconnect load failed: request=%s peer=- stage=params reason=%s", load.request_id, exc)
                self._refused[load.request_id] = str(exc)
                if params is not None:
                    self._release(params, load.request_id)  # the producer need not wait out its lease
        for offer in meta.offers:
            self._offer(offer)
        for release in meta.releases:
            try:
                self._release(from_vllm(release.params), release.request_id)
            except KVConnectError as exc:
                log.info("kvconnect: could not release the remote blocks of %s: %s", release.request_id, exc)
        for rid in meta.aborts:
            log.debug("kvconnect: abort %s", rid)
            if rid in self._held and rid not in self._pushed:
                self._abandoned.add(rid)
            core.abort(rid)

    def _offer(self, offer: Offer) -> None:
        log.debug("kvconnect: offer %s (push %s) to %s:%s", offer.request_id, offer.key, offer.host, offer.port)
        try:
            self.core.expect_push(offer.key, (offer.host, offer.port), offer.block_ids, offer.num_tokens,
                                  handle=offer.request_id)
            if self._dump is not None:  # named by the push key, as the prefill's dump is
                self._loading[offer.request_id] = (offer.key, offer.block_ids)
        except KVConnectError as exc:
            log.warning("kvconnect load failed: request=%s peer=%s:%s stage=offer reason=%s", offer.request_id,
                        offer.host, offer.port, exc)
            self._refused[offer.request_id] = str(exc)

    def _release(self, params, request_id: str) -> None:
        try:
            self.core.release_remote(params)
        except KVConnectError as exc:
            log.info("kvconnect: could not release the remote blocks of %s: %s", request_id, exc)

    def after_forward(self, meta: KVConnectMeta) -> None:
        """The forward pass that wrote these prompts' KV is done: hold them before vLLM can return them."""
        for hold in meta.holds:
            log.debug("kvconnect: hold %s", hold.request_id)
            if hold.request_id in self._streamed:
                pass  # pushed before the pass, layer by layer
            elif hold.push_key:
                self._pushed.add(hold.request_id)
                self._push(hold)
            else:
                self.core.request_finished(hold.request_id, hold.block_ids, hold.num_tokens)
            self._held.add(hold.request_id)
            if self._dump is not None:
                self._dump.write("held", hold.push_key or hold.request_id, hold.block_ids)
        if self._streamed:
            self._streamed.clear()
            self.core.forward_done()

    def layer_saved(self, layer_name: str, meta: KVConnectMeta | None) -> None:
        """Layer-wise push: the running pass computed this layer's KV; write it for the prompts the pass completes.

        vLLM starts a step's loads after its forward pass, so the pushes of the prompts this pass
        completes begin at its first computed layer.
        """
        if not self._layerwise or meta is None:
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
            sent = self.core.layers_saved((layer_name,))
            log.debug("kvconnect: layer %s computed, to %d running WRITE(s)", layer_name, sent)
            self._stats.add(layers_streamed=sent)

    def _push(self, hold: Hold, layerwise: bool = False) -> None:
        try:
            self.core.push(hold.push_key, hold.block_ids, handle=hold.request_id, layerwise=layerwise)
        except KVConnectError as exc:  # the blocks are reported sent (free) at the next results
            log.warning("kvconnect push failed: request=%s stage=params reason=%s", hold.request_id, exc)
            self._unpushed.append(hold.request_id)

    def results(self) -> KVConnectorTransferResults:
        """Sends whose blocks are free again and loads that ended since the last call."""
        out = KVConnectorTransferResults()
        if self.core is None:
            return out
        fin = self.core.get_finished()
        for rid, why in fin.push_failed.items():
            log.warning("kvconnect push failed: request=%s stage=write reason=%s", rid, why)
        fin.sending += self._unpushed
        self._unpushed = []
        for rid in fin.sending:
            self._held.discard(rid)
            self._pushed.discard(rid)
            if rid in self._abandoned:
                self._abandoned.discard(rid)
            else:
                out.finished_sending.add(rid)
        if self._dump is not None:
            for handle in fin.loaded:
                self._dump.write("loaded", *self._loading.pop(handle))
            for handle in fin.failed:
                self._loading.pop(handle, None)
        failed = {h: str(f) for h, f in fin.failed.items()}
        failed.update(self._refused)
        self._refused = {}
        out.finished_recving.update(fin.loaded, failed)
        out.failed_recving.update(failed)
        self._stats.add(loads_ok=len(fin.loaded), loads_failed=len(failed), sends_done=len(out.finished_sending))
        return out

    def stats(self) -> KVConnectStats | None:
        """This interval's counters, kvconnect's Prometheus increments included."""
        return self._stats.take()

    def shutdown(self) -> None:
        """Close the core (side channel, consumer, transport)."""
        core, self.core = self.core, None
        if core is not None:
            core.close()
