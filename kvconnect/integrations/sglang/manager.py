"""The kvconnect SGLang KV manager: SGLang's CommonKVManager for the bootstrap, kvconnect for the pages.

One manager per scheduler process (per TP rank). It registers SGLang's buffers with a
`KVConnector` (a producer on a prefill server, a consumer on a decode server) and serves its
half's control frames on SGLang's ZMQ socket. Senders and receivers call `pump()` when SGLang polls
them: it turns the connector's finished leases and loads into SGLang statuses.

Settings (environment, read once per server): `KVCONNECT_SGLANG_LEASE_S` (how long a prefill holds
a finished request's pages for its decode to claim them, default 30), `KVCONNECT_SGLANG_LOAD_TIMEOUT_S`
(a decode's whole load, default 60), `KVCONNECT_SGLANG_HANDSHAKE_TIMEOUT_S` (default 5). A decode
server needs SGLang's deferred KV release on, with a timeout no shorter than the load's (`deferral`).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any, Callable

from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvconnect.config import ConnectorConfig
from kvconnect.connector import KVConnector
from kvconnect.errors import KVConnectError
from kvconnect.integrations.sglang import buffers, deferral, faults, frames
from kvconnect.integrations.sglang.decode_side import DecodeSide
from kvconnect.integrations.sglang.prefill_side import PrefillSide

log = logging.getLogger(__name__)

_SETTINGS = {"lease_s": ("KVCONNECT_SGLANG_LEASE_S", 30.0),
             "load_timeout_s": ("KVCONNECT_SGLANG_LOAD_TIMEOUT_S", 60.0),
             "handshake_timeout_s": ("KVCONNECT_SGLANG_HANDSHAKE_TIMEOUT_S", 5.0)}


def settings(env: dict[str, str] | None = None) -> dict[str, float]:
    """The connector's deadlines from the environment (KVConnectError naming a bad variable)."""
    env = os.environ if env is None else env
    out = {}
    for key, (var, default) in _SETTINGS.items():
        try:
            out[key] = float(env.get(var, default))
        except ValueError:
            raise KVConnectError(f"{var} must be a number of seconds, got {env[var]!r}") from None
    return out


def kv_heads(args: Any, server_args: Any, tp: int) -> tuple[int, int]:
    """(KV heads of one rank, of the model): from `KVArgs` where SGLang set them (a prefill), else from the
    model's config by SGLang's own rule (a decode's `KVArgs` gets them only after its manager started)."""
    count, total = getattr(args, "kv_head_num", 0), getattr(args, "total_kv_head_num", 0)
    if count and total:
        return int(count), int(total)
    from sglang.srt.configs.model_config import ModelConfig

    config = ModelConfig.from_server_args(server_args)
    return int(config.get_num_kv_heads(tp)), int(config.get_total_num_kv_heads())


def engine_id(role: str, server_args: Any) -> str:
    """The kvconnect engine id of a server, the same on each of its TP ranks: a decode gathers the params
    of every prefill rank into one load, which names one engine (a restart is told by its incarnation)."""
    if role == "consumer":
        return f"sglang-consumer-{uuid.uuid4().hex[:12]}"  # readers are told apart by (engine id, rank)
    return f"sglang-producer-{server_args.host}:{server_args.port}"


class KVConnectManager(PrefillSide, DecodeSide, CommonKVManager):
    """SGLang's KV manager with kvconnect's data path; `transport` is set per backend name."""

    transport = "mooncake"
    kv_status_msg_tag = frames.STATUS
    kv_status_msg_carries_reason = True
    # An aborted or failed request's pages stay held until kvconnect reports its load ended.
    supports_deferred_decode_kv_release = True

    def __init__(self, args: Any, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._stopped = False
        self._pump_lock = threading.Lock()
        self.prefill = disaggregation_mode == DisaggregationMode.PREFILL
        limits = settings()
        if not self.prefill:
            limits["load_timeout_s"] = deferral.check(self.enable_deferred_decode_kv_release, limits["load_timeout_s"],
                                                      explicit=deferral.LOAD_TIMEOUT in os.environ)
        tp, rank = int(self.attn_tp_size), int(self.attn_tp_rank)
        held = buffers.from_kv_args(args, str(server_args.device), tp=tp, rank=rank, mla=bool(is_mla_backend),
                                    kv_heads=None if is_mla_backend else kv_heads(args, server_args, tp))
        role = "producer" if self.prefill else "consumer"
        config = ConnectorConfig(engine_id=engine_id(role, server_args), role=role, backend=self.transport,
                                 host=self.local_ip, block_size=int(args.page_size), groups=list(held.groups),
                                 rank=rank, world_size=tp, shards=held.shards() or None, **limits)
        self.connector = KVConnector(config, transport=None if self.prefill else faults.decode_transport(config))
        self.connector.register_kv_caches(held.tensors)
        self.held = held
        log.info("kvconnect sglang %s: %d regions (%d bytes) over %s, engine %s", role, len(self.connector.regions),
                 self.connector.regions.total_bytes, self.transport, config.engine_id)
        if self.prefill:
            self._start_prefill()
        else:
            self._start_decode()

    def _serve(self, handle: Callable[[list[bytes]], None]) -> None:
        """Read SGLang's socket until stopped; a frame that breaks its handler is logged, never fatal."""
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if msg is None:
                continue
            try:
                handle(msg)
            except Exception:
                log.exception("kvconnect sglang: a control frame failed")

    def pump(self) -> None:
        """Turn finished leases (prefill) or loads (decode) into statuses; one caller at a time, never waits."""
        if not self._pump_lock.acquire(blocking=False):
            return
        try:
            self._pump_prefill() if self.prefill else self._pump_decode()
        finally:
            self._pump_lock.release()

    def teardown(self) -> None:
        """Stop serving and close the connector (transport last)."""
        self._stopped = True
        self.connector.close()
