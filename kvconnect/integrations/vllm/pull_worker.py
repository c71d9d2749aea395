"""Pull mode, worker side: start the reads the scheduler ordered, release what needs no read.

The params arrive parsed (`TransferParams`, from the scheduler's metadata) and go to the core as
they are. A load the core refuses (block ids out of range, a TP size that cannot map) or one whose
params the scheduler refused is reported failed at the next results (stage params); the producer of
a refused load is told to free its blocks rather than wait out its lease.
"""

from __future__ import annotations

import logging

from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.integrations.vllm.meta import KVConnectMeta, LoadOrder
from kvconnect.integrations.vllm.pd_worker import PDWorkerBase
from kvconnect.pd.failure import LoadFailure, Stage

log = logging.getLogger("kvconnect.vllm")


class PullWorker(PDWorkerBase):
    """Reads remote prompts into this worker's blocks, as the scheduler orders."""

    def _start_transfers(self, meta: KVConnectMeta) -> None:
        for load in meta.loads:
            self._load(load)
        for refused in meta.refused:
            self._refuse(refused.request_id, LoadFailure(Stage.PARAMS, refused.reason))
        for release in meta.releases:
            self._release(release.params, release.request_id)

    def _load(self, load: LoadOrder) -> None:
        log.debug("kvconnect: load %s", load.request_id)
        try:
            self.core.start_load(load.params, load.block_ids, handle=load.request_id, timeout_s=load.timeout_s,
                                 decoded=True)
        except KVConnectError as exc:  # ids out of range, sizes that cannot map: the request fails as the policy says
            self._refuse(load.request_id, LoadFailure.of(Stage.PARAMS, exc))
            self._release(load.params, load.request_id)  # the producer need not wait out its lease
            return
        if self._dump is not None:
            self._loading[load.request_id] = (load.params.request_id, load.block_ids)

    def _refuse(self, rid: str, why: LoadFailure, peer: str = "-") -> None:
        """A load that never started: logged now, reported failed at the next results."""
        log.warning("kvconnect load failed: request=%s peer=%s stage=%s reason=%s", rid, peer, why.stage, why.reason)
        self._refused[rid] = str(why.reason)

    def _release(self, params: wire.TransferParams, request_id: str) -> None:
        try:
            self.core.release_remote(params, decoded=True)
        except KVConnectError as exc:
            log.info("kvconnect: could not release the remote blocks of %s: %s", request_id, exc)
