"""The classes SGLang asks `get_kv_class` for, per kvconnect transport: manager, sender, receiver,
bootstrap server (SGLang's own)."""

from __future__ import annotations

import functools
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVReceiver, CommonKVSender
from sglang.srt.disaggregation.utils import KVClassType

from kvconnect.integrations.sglang.manager import KVConnectManager
from kvconnect.integrations.sglang.prefill_side import lease_id


class KVConnectSender(CommonKVSender):
    """SGLang's sender; its status comes from the manager's kvconnect lease."""

    # Plain numpy page indices: no pinned host copy, no device event (kvconnect reads host memory).
    supports_host_tensor_indices = False

    def poll(self) -> KVPoll:
        """SGLang's poll, after the manager turned finished leases into statuses."""
        self.kv_mgr.pump()
        return super().poll()

    def abort(self) -> None:
        """Fail the request and release its lease (a decode reading it is refused from now on)."""
        super().abort()
        self.kv_mgr.connector.abort(lease_id(self.bootstrap_room))

    def clear(self) -> None:
        """SGLang's clear, and the chunks collected for the room."""
        self.kv_mgr.forget_room(self.bootstrap_room)
        super().clear()


class KVConnectReceiver(CommonKVReceiver):
    """SGLang's receiver; its status comes from the manager's kvconnect load."""

    def send_metadata(self, *args: Any, **kwargs: Any) -> None:
        """SGLang's request to the prefill ranks, after noting their hosts: params naming others are refused."""
        if self.bootstrap_infos:
            self.kv_mgr.expect_params_from(self.bootstrap_room,
                                           frozenset(str(info["rank_ip"]) for info in self.bootstrap_infos))
        super().send_metadata(*args, **kwargs)

    def poll(self) -> KVPoll:
        """SGLang's poll, after the manager turned finished loads into statuses."""
        self.kv_mgr.pump()
        return super().poll()

    def abort(self) -> None:
        """Tell the prefill (SGLang's abort frame) and fail a running load."""
        super().abort()
        self.kv_mgr.abort_load(self.bootstrap_room)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang's notice before it holds a failed request's pages: cancel the load it waits on, if one runs."""
        super().ensure_abort_notified(force_arm=force_arm)
        self.kv_mgr.abort_load(self.bootstrap_room)

    def clear(self) -> None:
        """SGLang's clear, and the pages remembered for the room."""
        if self.conclude_state != KVPoll.Success:
            self.kv_mgr.abort_load(self.bootstrap_room)
        super().clear()


class KVConnectBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server, unchanged: decode learns from it where the prefill ranks are."""


@functools.cache
def classes(transport: str) -> dict[Any, type]:
    """SGLang's KV classes for one kvconnect transport (`mooncake` or `nixl`)."""
    manager = type(f"KVConnect{transport.title()}Manager", (KVConnectManager,), {"transport": transport})
    return {KVClassType.MANAGER: manager, KVClassType.SENDER: KVConnectSender,
            KVClassType.RECEIVER: KVConnectReceiver, KVClassType.BOOTSTRAP_SERVER: KVConnectBootstrapServer}
