"""Pull mode, scheduler side: prefill hands out transfer params, decode reads the blocks they name.

Decode: a request with `do_remote_prefill` is an asynchronous external hit for the tokens prefill
computed. Its kv_transfer_params are parsed once, when the scheduler first sees it
(`on_new_request`), into `TransferParams`, which travel as they are to the worker and the core; the
producer's lease is heartbeated from that moment, so a long queue never loses it. After allocation
the worker is told which local blocks to pull into (`LoadOrder`), or, with nothing to pull, to
release the producer's blocks (`ReleaseOrder`). Params refused at parsing still make a load, one the
worker reports failed (`RefusedLoad`, stage params), so vLLM's failure policy decides. A router's
per-request deadline (`kvconnect_load_timeout_s`, capped at `load_timeout_s`) is read with them and
travels in the `LoadOrder`.
A pull instance refuses requests a router sent in push mode: they are computed here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.integrations.vllm.config import PDConfig
from kvconnect.integrations.vllm.groups import Groups
from kvconnect.integrations.vllm.meta import LoadOrder, RefusedLoad, ReleaseOrder
from kvconnect.integrations.vllm.params import (from_vllm, load_timeout, push_key, push_source, to_vllm,
                                                 wants_remote_prefill)
from kvconnect.integrations.vllm.pd_scheduler import Held, PDSchedulerBase
from kvconnect.pd.keeper import LeaseKeeper

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("kvconnect.vllm")


class PullScheduler(PDSchedulerBase):
    """Hands out held prompts as params (prefill) and orders the loads they name (decode)."""

    mode = "pull"

    def __init__(self, config: PDConfig, *, engine_id: str, groups: Groups,
                 blocks_of: Callable[[str], tuple[list[int], ...]]):
        super().__init__(config, engine_id=engine_id, groups=groups, blocks_of=blocks_of)
        # decode request -> its parsed params, or why they were refused
        self._pulls: dict[str, wire.TransferParams | KVConnectError] = {}
        self._timeouts: dict[str, float] = {}  # decode request -> the router's shorter load deadline
        self._keeper = LeaseKeeper(engine_id=engine_id, secret=config.secret, heartbeat_s=config.heartbeat_s,
                                   timeout_s=config.handshake_timeout_s)

    # ---- decode ----

    def _on_decode_request(self, request: Request) -> None:
        if self._push_request(request) or not wants_remote_prefill(request.kv_transfer_params):
            return
        rid = request.request_id
        try:
            params = from_vllm(request.kv_transfer_params)
        except KVConnectError as exc:
            self._pulls[rid] = exc  # the load is refused with the reason once the request is scheduled
            return
        try:
            timeout = load_timeout(request.kv_transfer_params, self.config.load_timeout_s)
        except KVConnectError as exc:
            self._pulls[rid] = exc
            self._release(rid, params)  # no load will read them: the producer need not wait out its lease
            return
        log.debug("kvconnect: %s reads %s", rid, params.request_id)
        self._keeper.track(params)
        self._pulls[rid] = params
        if timeout is not None:
            self._timeouts[rid] = timeout

    def _push_request(self, request: Request) -> bool:
        """Whether a decode request was routed in push mode (refused here: it is computed locally)."""
        params, rid = request.kv_transfer_params, request.request_id
        try:
            if push_source(params) is None:
                return False
            why = f"a push-mode request, and this instance runs mode {self.mode!r}"
        except KVConnectError as exc:
            why = str(exc)
        log.warning("kvconnect load failed: request=%s peer=- stage=params reason=%s; computing it here", rid, why)
        params["do_remote_prefill"] = False
        return True

    def _parsed(self, request: Request) -> wire.TransferParams | KVConnectError:
        pull = self._pulls.get(request.request_id)
        if pull is None:  # a request vLLM never announced: parsed now, still once
            self._on_decode_request(request)
            pull = self._pulls.get(request.request_id, KVConnectError("not a pull request"))
        return pull

    def _matched(self, request: Request) -> int:
        if not wants_remote_prefill(request.kv_transfer_params):
            return 0
        return self.remote_tokens(request)

    def remote_tokens(self, request: Request) -> int:
        """How many prompt tokens a decode request loads: those prefill computed, when decode can use them."""
        n_prompt = len(request.prompt_token_ids or ())
        pull = self._parsed(request)
        remote = pull.num_tokens if isinstance(pull, wire.TransferParams) else \
            request.kv_transfer_params.get("remote_num_tokens", n_prompt)
        if not isinstance(remote, int) or isinstance(remote, bool):
            return 0
        backoff = self.groups.prefill_backoff
        if backoff and remote != n_prompt - backoff:
            return 0  # a whole-sequence state of other tokens than decode has left to feed: recompute
        return min(remote, n_prompt)

    def _after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params, rid = request.kv_transfer_params, request.request_id
        if not wants_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        pull = self._parsed(request)
        if num_external_tokens > 0:
            local = self.groups.select(blocks.get_unhashed_block_ids_all_groups(), self.remote_tokens(request))
            if isinstance(pull, wire.TransferParams):
                self._meta.loads.append(LoadOrder(request_id=rid, block_ids=local, params=pull,
                                                  timeout_s=self._timeouts.get(rid)))
            else:
                self._meta.refused.append(RefusedLoad(request_id=rid, reason=str(pull)))
        else:
            # A full local prefix hit: nothing to pull, but the producer must free its blocks.
            self._release(rid, pull)
            self._stop_keeping(rid)

    def _release(self, rid: str, pull: wire.TransferParams | KVConnectError) -> None:
        if isinstance(pull, wire.TransferParams):
            self._meta.releases.append(ReleaseOrder(request_id=rid, params=pull))
        else:
            log.info("kvconnect: could not release the remote blocks of %s: %s", rid, pull)

    def _decode_finished(self, request: Request) -> None:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        pull = self._pulls.get(rid)
        if not isinstance(pull, wire.TransferParams):
            self._pulls.pop(rid, None)
            return
        if wants_remote_prefill(request.kv_transfer_params):
            # Finished before it was ever allocated (aborted in the queue): free the producer's blocks.
            request.kv_transfer_params["do_remote_prefill"] = False
            self._release(rid, pull)
        elif request.status == RequestStatus.FINISHED_ABORTED:
            self._meta.aborts.append(rid)  # vLLM frees the blocks once the worker reports the load ended
        self._stop_keeping(rid)

    def _load_ended(self, rid: str) -> None:
        self._stop_keeping(rid)

    def _stop_keeping(self, rid: str) -> None:
        self._timeouts.pop(rid, None)
        pull = self._pulls.pop(rid, None)
        if isinstance(pull, wire.TransferParams):
            self._keeper.untrack(pull.request_id)

    # ---- prefill ----

    def _push_key(self, request: Request) -> str:
        try:
            if push_key(request.kv_transfer_params) is None:
                return ""
            why = f"this instance runs mode {self.mode!r}"
        except KVConnectError as exc:
            why = str(exc)
        log.warning("kvconnect push failed: request=%s stage=params reason=%s; holding it for a pull",
                    request.request_id, why)
        return ""

    def _hand_out(self, rid: str, held: Held) -> dict[str, Any] | None:
        ids, ntok, t0 = held
        p = wire.TransferParams(engine_id=self._peer.engine_id, host=self._peer.host, port=self._peer.port,
                                request_id=rid, block_ids=ids, num_tokens=ntok,
                                lease_expiry=t0 + self.config.lease_s, incarnation=self._peer.incarnation,
                                ranks=self._ranks)
        return to_vllm(p)

    # ---- both ----

    def stats(self) -> dict[str, int]:
        """The shared counts, and the leases being kept alive for queued decode requests."""
        return {**super().stats(), "kept_alive": self._keeper.tracked}

    def shutdown(self) -> None:
        """Stop heartbeating."""
        self._keeper.close()
