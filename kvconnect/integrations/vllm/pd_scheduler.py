"""What the scheduler-side halves of KVConnectNixl and KVConnectMooncake share, whatever the mode.

Prefill: a request with `do_remote_decode` is tracked; in the step that computes the end of its
prompt the worker is told to hold its blocks (`HoldOrder`, per group the blocks `groups` selects),
right after that forward pass and before the engine can return the request; `request_finished` then
keeps the blocks and hands them out. A model with a whole-sequence state (Mamba) stops one prompt
token short, so that decode feeds it on top of the state it loads (see `groups`).
Decode requests, and how held blocks are handed out, are the mode's: `pull_scheduler` (params for
decode to read with) and `push_scheduler` (offers, and WRITEs instead of params). The mode's class is
chosen once, when vLLM builds the connector.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from kvconnect import wire
from kvconnect.integrations.vllm.config import PDConfig
from kvconnect.integrations.vllm.groups import Groups
from kvconnect.integrations.vllm.meta import HoldOrder, KVConnectHandshake, KVConnectMeta
from kvconnect.integrations.vllm.params import wants_identity, wants_remote_decode
from kvconnect.integrations.vllm.stats import AT, StatsFile

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvconnect.vllm")

# Worker counts (increments in vLLM's connector stats) that the stats file shows, by the name it uses.
_WORKER_KEYS = {"loads_ok": "loads_ok", "loads_failed": "loads_failed", "layers_streamed": "layers_streamed"}
# Worker gauges: each worker process reports its current value as `name@source`; the file shows their sum.
_WORKER_GAUGES = {"kvconnect_leases_held": "worker_leases_held"}

Held = tuple[list[list[int]], int, float]  # a held prompt's block ids, tokens, hold time


class PDSchedulerBase:
    """Decides, per step, which prompts' blocks the worker holds; the mode's subclass does the rest."""

    mode = ""

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
        self._held: dict[str, Held] = {}
        self._sending: dict[str, int] = {}  # request -> blocks vLLM keeps for it until finished_sending
        self._counters = {"handed_out": 0, "released": 0}
        self._worker: dict[str, float] = {}  # what the workers reported, summed (their leases, their loads)
        self._gauges: dict[str, dict[str, float]] = {}  # worker gauge -> {its process: latest value}
        self._stats_file = StatsFile(config.stats_path)

    # ---- the mode's hooks ----

    def _on_decode_request(self, request: Request) -> None:
        """A new request that is not a prefill for a remote decode."""

    def _matched(self, request: Request) -> int:
        """How many prompt tokens a decode request loads from its remote prefill (0: none)."""
        return 0

    def _after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """A decode request got its blocks."""

    def _decode_finished(self, request: Request) -> None:
        """A decode request finished (or was aborted)."""

    def _push_key(self, request: Request) -> str:
        """The push key a held prompt is written under ("" to hand it out for a pull)."""
        return ""

    def _hand_out(self, rid: str, held: Held) -> dict[str, Any] | None:
        """What `request_finished` returns for a held prompt the engine finished."""
        return None

    def _give_up(self, rid: str, held: Held) -> bool:
        """A held prompt that will not be handed out: whether vLLM must keep its blocks until the worker says."""
        return False

    def _load_ended(self, rid: str) -> None:
        """A decode request's transfer ended (loaded or failed)."""

    # ---- vLLM's hooks ----

    def on_new_request(self, request: Request) -> None:
        """Prefill: stop short of the tokens decode must feed itself. Decode: the mode's."""
        if wants_identity(request.kv_transfer_params):
            return
        if wants_remote_decode(request.kv_transfer_params):
            self._leave_to_decode(request)
        self._on_decode_request(request)

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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The tokens prefill computed are an asynchronous external hit for a remotely prefilled request."""
        count = self._matched(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Prefill: track the prompt until it is computed. Decode: the mode's (pull into the blocks, or offer them)."""
        params = request.kv_transfer_params
        if wants_remote_decode(params) and not wants_identity(params):
            self._prefilling[request.request_id] = request
        else:
            self._after_alloc(request, blocks, num_external_tokens)

    def build_meta(self, scheduled: dict[str, int]) -> KVConnectMeta:
        """This step's instructions; holds for every tracked prompt computed to its end in this step."""
        meta, self._meta = self._meta, KVConnectMeta()
        for rid, req in list(self._prefilling.items()):
            n = scheduled.get(rid, 0)
            if n and req.num_computed_tokens + n >= req.num_prompt_tokens:
                ntok = req.num_prompt_tokens
                ids = self.groups.select(self._blocks_of(rid), ntok)
                meta.holds.append(HoldOrder(request_id=rid, block_ids=ids, num_tokens=ntok,
                                            push_key=self._push_key(req)))
                self._held[rid] = (ids, ntok, time.time())
                del self._prefilling[rid]
        return meta

    def request_finished(self, request: Request, block_ids: Any = None) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: keep a held request's blocks and hand them out. Decode: the mode's (abort what is in flight)."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._prefilling.pop(rid, None)
        if wants_identity(request.kv_transfer_params):
            return False, self._identity()
        self._decode_finished(request)
        held = self._held.pop(rid, None)
        if held is None:
            return False, None
        finished = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not finished or self._peer is None:
            if self._peer is None:
                log.error("kvconnect: no handshake metadata from the worker; cannot hand out %s", rid)
            self._meta.aborts.append(rid)
            if self._give_up(rid, held):
                self._sending[rid] = sum(len(g) for g in held[0])
                return True, None
            return False, None
        self._sending[rid] = sum(len(g) for g in held[0])
        self._counters["handed_out"] += 1
        return True, self._hand_out(rid, held)

    def _identity(self) -> dict[str, Any]:
        """Who this instance is, for a router that sends decode instances here in push mode."""
        if self._peer is None:
            return {"kvconnect_identify": False}
        out = {"remote_engine_id": self._peer.engine_id, "remote_host": self._peer.host,
               "remote_port": self._peer.port, "tp_size": max(len(self._ranks), 1), "mode": self.mode}
        if self._ranks:  # a push decode finds rank r at port + r: the router checks they are there
            out["remote_ranks"] = [[r.host, r.port] for r in self._ranks]
        return out

    def set_handshake(self, metadata: dict[int, KVConnectHandshake]) -> None:
        """The workers' side channels, one per TP rank, which handed-out params point decode instances at."""
        if 0 in metadata:
            self._peer = metadata[0]
            ranks = tuple(wire.RankAddr(host=m.host, port=m.port, incarnation=m.incarnation)
                          for _, m in sorted(metadata.items()))
            self._ranks = ranks if len(ranks) > 1 else ()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Transfers that ended are forgotten; released sends are counted; workers' counters summed."""
        for rid in output.finished_recving or ():
            self._load_ended(rid)
        for rid in output.finished_sending or ():
            if self._sending.pop(rid, None) is not None:
                self._counters["released"] += 1
        worker = getattr(output.kv_connector_stats, "data", None) or {}
        for key, name in _WORKER_KEYS.items():
            if key in worker:
                self._worker[name] = self._worker.get(name, 0) + worker[key]
        for key, value in worker.items():
            gauge, _, src = key.partition(AT)
            if src and gauge in _WORKER_GAUGES:
                self._gauges.setdefault(gauge, {})[src] = value
                self._worker[_WORKER_GAUGES[gauge]] = sum(self._gauges[gauge].values())
        self._stats_file.write(self.stats())

    def stats(self) -> dict[str, int]:
        """Requests handed out and released, blocks still held for consumers, and the workers' own counts:
        leases their producers hold, loads finished and failed."""
        return {**self._counters, "held_requests": len(self._sending), "held_blocks": sum(self._sending.values()),
                **{k: int(v) for k, v in self._worker.items()}}

    def shutdown(self) -> None:
        """Nothing runs here without a mode."""


def __getattr__(name: str) -> object:
    if name == "PDScheduler":
        raise AttributeError("PDScheduler was split by mode: kvconnect.integrations.vllm.pull_scheduler.PullScheduler "
                             "and kvconnect.integrations.vllm.push_scheduler.PushScheduler, over PDSchedulerBase")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
