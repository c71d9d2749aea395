"""The scheduler-side half of KVConnectNixl and KVConnectMooncake: what to hold, load, release, abort.

Prefill: a request with `do_remote_decode` is tracked; in the step that computes the end of its
prompt the worker is told to hold its blocks (`Hold`, per group the blocks `groups` selects), right
after that forward pass and before the engine can return the request; `request_finished` then keeps
the blocks and hands out the params. A model with a whole-sequence state (Mamba) stops one prompt
token short, so that decode feeds it on top of the state it loads (see `groups`).
Decode: a request with `do_remote_prefill` is an asynchronous external hit for the tokens prefill
computed; its producer's lease is heartbeated from the moment the scheduler sees it
(`on_new_request`), so a long queue never loses it; after allocation the worker is told which local
blocks to pull into (`Load`), or, with nothing to pull, to release the producer's blocks (`Release`).
Push mode (`push_key` in the params): the decode offers its blocks right after allocation (`Offer`)
and waits for the WRITE like for a load; the prefill holds as in pull and writes instead of handing
out params.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.integrations.vllm.config import PDConfig
from kvconnect.integrations.vllm.groups import Groups
from kvconnect.integrations.vllm.meta import Hold, KVConnectHandshake, KVConnectMeta, Load, Offer, Release
from kvconnect.integrations.vllm.params import (
    PushSource,
    from_vllm,
    push_key,
    push_source,
    to_vllm,
    wants_identity,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvconnect.integrations.vllm.stats import StatsFile
from kvconnect.pd.keeper import LeaseKeeper

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvconnect.vllm")

# Worker counters (reported through vLLM's connector stats) that the stats file shows, by the name it uses.
_WORKER_KEYS = {"kvconnect_leases_held": "worker_leases_held", "loads_ok": "loads_ok", "loads_failed": "loads_failed",
                "layers_streamed": "layers_streamed"}


class PDScheduler:
    """Decides, per step, which requests' blocks the worker holds, pulls, releases or aborts."""

    def __init__(self, config: PDConfig, *, engine_id: str, groups: Groups,
                 blocks_of: Callable[[str], tuple[list[int], ...]]):
        self.config = config
        self.engine_id = engine_id
        self.groups = groups
        self._blocks_of = blocks_of
        self._peer: KVConnectHandshake | None = None
        self._ranks: tuple[wire.RankAddr, ...] = ()  # every TP rank's side channel, when there are several
        self._meta = KVConnectMeta()
        self._prefilling: dict[str, Request] = {}  # do_remote_decode requests not yet held
        self._held: dict[str, tuple[list[list[int]], int, float]] = {}  # ids, tokens, hold time
        self._sending: dict[str, int] = {}  # request -> blocks vLLM keeps for it until finished_sending
        self._loading: dict[str, str] = {}  # decode request -> producer request id it reads
        self._pushing: dict[str, PushSource] = {}  # decode request -> the push it waits for
        self._push_held: set[str] = set()  # prefill requests held to be written into a decode's blocks
        self._counters = {"handed_out": 0, "released": 0}
        self._worker: dict[str, float] = {}  # what the workers reported, summed (their leases, their loads)
        self._stats_file = StatsFile(config.stats_path)
        self._keeper = LeaseKeeper(engine_id=engine_id, secret=config.secret, heartbeat_s=config.heartbeat_s,
                                   timeout_s=config.handshake_timeout_s)

    # ---- decode side ----

    def on_new_request(self, request: Request) -> None:
        """Prefill: stop short of the tokens decode must feed itself. Decode: keep the lease alive."""
        if wants_identity(request.kv_transfer_params):
            return
        if wants_remote_decode(request.kv_transfer_params):
            self._leave_to_decode(request)
        if self._push_source(request) is not None:
            return
        if not wants_remote_prefill(request.kv_transfer_params):
            return
        try:
            params = from_vllm(request.kv_transfer_params)
        except KVConnectError:
            return  # the load refuses them with the reason once the request is scheduled
        log.debug("kvconnect: %s reads %s", request.request_id, params.request_id)
        self._keeper.track(params)
        self._loading[request.request_id] = params.request_id

    def _leave_to_decode(self, request: Request) -> None:
        backoff, params = self.groups.prefill_backoff, request.kv_transfer_params
        if not backoff or params.get("_kvconnect_backoff") or request.num_prompt_tokens <= backoff \
                or request.prompt_token_ids is None:
            return
        # vLLM's own contract for this (its NIXL connector does the same): the prompt the prefill
        # computes ends `backoff` tokens early, and it samples nothing decode would use.
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params["_kvconnect_backoff"] = backoff

    def _push_source(self, request: Request) -> PushSource | None:
        """Where a push-mode decode request's prefill is (None for a pull, or push params that are unusable)."""
        rid = request.request_id
        if rid in self._pushing:
            return self._pushing[rid]
        try:
            source = push_source(request.kv_transfer_params)
        except KVConnectError as exc:
            log.warning("kvconnect load failed: request=%s peer=- stage=params reason=%s; computing it here", rid, exc)
            request.kv_transfer_params["do_remote_prefill"] = False
            return None
        if source is not None and self.config.mode != "push":
            log.warning("kvconnect load failed: request=%s peer=- stage=params reason=a push-mode request, and this "
                        "instance runs mode %r; computing it here", rid, self.config.mode)
            request.kv_transfer_params["do_remote_prefill"] = False
            return None
        if source is not None:
            self._pushing[rid] = source
        return source

    def remote_tokens(self, request: Request) -> int:
        """How many prompt tokens a decode request loads: those prefill computed, when decode can use them."""
        n_prompt = len(request.prompt_token_ids or ())
        if request.request_id in self._pushing:  # the prefill computes what pull's would have
            return max(n_prompt - self.groups.prefill_backoff, 0) if self.groups.prefill_backoff else n_prompt
        remote = request.kv_transfer_params.get("remote_num_tokens", n_prompt)
        if not isinstance(remote, int) or isinstance(remote, bool):
            return 0
        backoff = self.groups.prefill_backoff
        if backoff and remote != n_prompt - backoff:
            return 0  # a whole-sequence state of other tokens than decode has left to feed: recompute
        return min(remote, n_prompt)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The tokens prefill computed are an asynchronous external hit for a remotely prefilled request."""
        params = request.kv_transfer_params
        if wants_remote_prefill(params) or (params and params.get("do_remote_prefill")
                                            and self._push_source(request) is not None):
            count = self.remote_tokens(request) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Tell the worker to pull into the allocated blocks (or, with nothing to pull, to release the lease)."""
        params = request.kv_transfer_params
        if wants_remote_decode(params) and not wants_identity(params):
            self._prefilling[request.request_id] = request
        elif params and params.get("do_remote_prefill") and request.request_id in self._pushing:
            params["do_remote_prefill"] = False  # one offer per request
            source = self._pushing[request.request_id]
            if num_external_tokens > 0:
                ntok = self.remote_tokens(request)
                local = self.groups.select(blocks.get_unhashed_block_ids_all_groups(), ntok)
                self._meta.offers.append(Offer(request_id=request.request_id, block_ids=local, num_tokens=ntok,
                                               key=source.key, host=source.host, port=source.port))
            else:
                self._pushing.pop(request.request_id)
        elif wants_remote_prefill(params):
            params["do_remote_prefill"] = False  # one transfer per request
            if num_external_tokens > 0:
                local = self.groups.select(blocks.get_unhashed_block_ids_all_groups(), self.remote_tokens(request))
                self._meta.loads.append(Load(request_id=request.request_id, block_ids=local, params=dict(params)))
            else:
                # A full local prefix hit: nothing to pull, but the producer must free its blocks.
                self._meta.releases.append(Release(request_id=request.request_id, params=dict(params)))
                self._stop_keeping(request.request_id)

    # ---- prefill side ----

    def build_meta(self, scheduled: dict[str, int]) -> KVConnectMeta:
        """This step's instructions; holds for every tracked prompt computed to its end in this step."""
        meta, self._meta = self._meta, KVConnectMeta()
        for rid, req in list(self._prefilling.items()):
            n = scheduled.get(rid, 0)
            if n and req.num_computed_tokens + n >= req.num_prompt_tokens:
                ntok = req.num_prompt_tokens
                ids = self.groups.select(self._blocks_of(rid), ntok)
                try:
                    key = push_key(req.kv_transfer_params) or ""
                except KVConnectError as exc:
                    log.warning("kvconnect push failed: request=%s stage=params reason=%s; holding it for a pull",
                                rid, exc)
                    key = ""
                if key and self.config.mode != "push":
                    log.warning("kvconnect push failed: request=%s stage=params reason=this instance runs mode %r; "
                                "holding it for a pull", rid, self.config.mode)
                    key = ""
                meta.holds.append(Hold(request_id=rid, block_ids=ids, num_tokens=ntok, push_key=key))
                if key:
                    self._push_held.add(rid)
                self._held[rid] = (ids, ntok, time.time())
                del self._prefilling[rid]
        return meta

    def request_finished(self, request: Request, block_ids: Any = None) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: keep a held request's blocks and hand out its params. Decode: abort a load in flight."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._prefilling.pop(rid, None)
        params = request.kv_transfer_params
        if wants_identity(params):
            return False, self._identity()
        source = self._pushing.pop(rid, None)
        if source is not None and not params.get("do_remote_prefill") \
                and request.status == RequestStatus.FINISHED_ABORTED:
            self._meta.aborts.append(rid)  # an offer was made: vLLM frees the blocks once the push ended
        if rid in self._loading:
            if wants_remote_prefill(params):
                # Finished before it was ever allocated (aborted in the queue): free the producer's blocks.
                params["do_remote_prefill"] = False
                self._meta.releases.append(Release(request_id=rid, params=dict(params)))
            elif request.status == RequestStatus.FINISHED_ABORTED:
                self._meta.aborts.append(rid)  # vLLM frees the blocks once the worker reports the load ended
            self._stop_keeping(rid)
        held = self._held.pop(rid, None)
        if held is None:
            return False, None
        finished = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not finished or self._peer is None:
            if self._peer is None:
                log.error("kvconnect: no handshake metadata from the worker; cannot hand out %s", rid)
            self._meta.aborts.append(rid)
            if rid in self._push_held:  # a WRITE may be reading them: free once the worker says the push ended
                self._push_held.discard(rid)
                self._sending[rid] = sum(len(g) for g in held[0])
                return True, None
            return False, None
        ids, ntok, t0 = held
        self._sending[rid] = sum(len(g) for g in ids)
        self._counters["handed_out"] += 1
        if rid in self._push_held:
            self._push_held.discard(rid)
            return True, None  # the worker writes them into the decode's blocks, then frees them
        p = wire.TransferParams(engine_id=self._peer.engine_id, host=self._peer.host, port=self._peer.port,
                                request_id=rid, block_ids=ids, num_tokens=ntok,
                                lease_expiry=t0 + self.config.lease_s, incarnation=self._peer.incarnation,
                                ranks=self._ranks)
        return True, to_vllm(p)

    def _identity(self) -> dict[str, Any]:
        """Who this instance is, for a router that sends decode instances here in push mode."""
        if self._peer is None:
            return {"kvconnect_identify": False}
        return {"remote_engine_id": self._peer.engine_id, "remote_host": self._peer.host,
                "remote_port": self._peer.port, "tp_size": max(len(self._ranks), 1), "mode": self.config.mode}

    def set_handshake(self, metadata: dict[int, KVConnectHandshake]) -> None:
        """The workers' side channels, one per TP rank, which transfer params point decode instances at."""
        if 0 in metadata:
            self._peer = metadata[0]
            ranks = tuple(wire.RankAddr(host=m.host, port=m.port, incarnation=m.incarnation)
                          for _, m in sorted(metadata.items()))
            self._ranks = ranks if len(ranks) > 1 else ()

    # ---- both ----

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Loads that ended stop being kept alive; released sends are counted; workers' counters summed."""
        for rid in output.finished_recving or ():
            self._stop_keeping(rid)
            self._pushing.pop(rid, None)
        for rid in output.finished_sending or ():
            if self._sending.pop(rid, None) is not None:
                self._counters["released"] += 1
        worker = getattr(output.kv_connector_stats, "data", None) or {}
        for key, name in _WORKER_KEYS.items():
            if key in worker:
                self._worker[name] = self._worker.get(name, 0) + worker[key]
        self._stats_file.write(self.stats())

    def stats(self) -> dict[str, int]:
        """Requests handed out and released, blocks still held for consumers, leases being kept alive, and
        the workers' own counts: leases their producers hold, loads finished and failed."""
        return {**self._counters, "held_requests": len(self._sending), "held_blocks": sum(self._sending.values()),
                "kept_alive": self._keeper.tracked, **{k: int(v) for k, v in self._worker.items()}}

    def shutdown(self) -> None:
        """Stop heartbeating."""
        self._keeper.close()

    def _stop_keeping(self, rid: str) -> None:
        remote = self._loading.pop(rid, None)
        if remote is not None:
            self._keeper.untrack(remote)
