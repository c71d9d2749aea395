"""Push mode, scheduler side: decode offers its blocks, prefill writes into them.

A router in push mode sends both halves of a request at once (`push_key` in both params). Decode:
the request's push params are read once, when the scheduler first sees it; right after allocation
the decode offers its blocks to the prefill (`OfferOrder`) and waits for the WRITE like for a load,
holding them for `load_timeout_s` or the router's shorter `kvconnect_load_timeout_s`.
Prefill: the prompt is held as in pull mode, then written into the offered blocks instead of being
handed out as params; vLLM keeps the blocks until the worker says the WRITE ended.
A push instance serves requests routed in pull mode too (the pull scheduler's part).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from kvconnect.errors import KVConnectError
from kvconnect.integrations.vllm.config import PDConfig
from kvconnect.integrations.vllm.groups import Groups
from kvconnect.integrations.vllm.meta import OfferOrder
from kvconnect.integrations.vllm.params import PushSource, load_timeout, push_key, push_source
from kvconnect.integrations.vllm.pd_scheduler import Held
from kvconnect.integrations.vllm.pull_scheduler import PullScheduler

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("kvconnect.vllm")


class PushScheduler(PullScheduler):
    """Orders a decode's offers and a prefill's WRITEs; pull-routed requests go the pull way."""

    mode = "push"

    def __init__(self, config: PDConfig, *, engine_id: str, groups: Groups,
                 blocks_of: Callable[[str], tuple[list[int], ...]]):
        super().__init__(config, engine_id=engine_id, groups=groups, blocks_of=blocks_of)
        self._pushing: dict[str, PushSource] = {}  # decode request -> the push it waits for
        self._push_held: set[str] = set()  # prefill requests held to be written into a decode's blocks

    # ---- decode ----

    def _push_request(self, request: Request) -> bool:
        rid = request.request_id
        try:
            source = push_source(request.kv_transfer_params)
            if source is not None:
                source = source._replace(timeout_s=load_timeout(request.kv_transfer_params,
                                                                self.config.load_timeout_s))
        except KVConnectError as exc:
            log.warning("kvconnect load failed: request=%s peer=- stage=params reason=%s; computing it here", rid, exc)
            request.kv_transfer_params["do_remote_prefill"] = False
            return True
        if source is None:
            return False
        self._pushing[rid] = source
        return True

    def _matched(self, request: Request) -> int:
        if request.request_id not in self._pushing:
            return super()._matched(request)
        if not request.kv_transfer_params.get("do_remote_prefill"):
            return 0
        return self._push_tokens(request)

    def _push_tokens(self, request: Request) -> int:
        """The prompt tokens a push-routed decode request is written: what a pull would have read."""
        n_prompt = len(request.prompt_token_ids or ())
        backoff = self.groups.prefill_backoff
        return max(n_prompt - backoff, 0) if backoff else n_prompt

    def _after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params, rid = request.kv_transfer_params, request.request_id
        source = self._pushing.get(rid)
        if source is None or not (params and params.get("do_remote_prefill")):
            super()._after_alloc(request, blocks, num_external_tokens)
            return
        params["do_remote_prefill"] = False  # one offer per request
        if num_external_tokens <= 0:
            self._pushing.pop(rid)
            return
        ntok = self._push_tokens(request)
        local = self.groups.select(blocks.get_unhashed_block_ids_all_groups(), ntok)
        self._meta.offers.append(OfferOrder(request_id=rid, block_ids=local, num_tokens=ntok, key=source.key,
                                            host=source.host, port=source.port, tp_size=source.tp_size,
                                            timeout_s=source.timeout_s))

    def _decode_finished(self, request: Request) -> None:
        from vllm.v1.request import RequestStatus

        if self._pushing.pop(request.request_id, None) is None:
            super()._decode_finished(request)
        elif not request.kv_transfer_params.get("do_remote_prefill") \
                and request.status == RequestStatus.FINISHED_ABORTED:
            self._meta.aborts.append(request.request_id)  # an offer was made: freed once the push ended

    def _load_ended(self, rid: str) -> None:
        self._pushing.pop(rid, None)
        super()._load_ended(rid)

    # ---- prefill ----

    def _push_key(self, request: Request) -> str:
        try:
            key = push_key(request.kv_transfer_params) or ""
        except KVConnectError as exc:
            log.warning("kvconnect push failed: request=%s stage=params reason=%s; holding it for a pull",
                        request.request_id, exc)
            return ""
        if key:
            self._push_held.add(request.request_id)
        return key

    def _give_up(self, rid: str, held: Held) -> bool:
        if rid not in self._push_held:
            return False
        self._push_held.discard(rid)  # a WRITE may be reading them: freed once the worker says the push ended
        return True

    def _hand_out(self, rid: str, held: Held) -> dict[str, Any] | None:
        if rid not in self._push_held:
            return super()._hand_out(rid, held)
        self._push_held.discard(rid)
        return None  # the worker writes them into the decode's blocks, then frees them
