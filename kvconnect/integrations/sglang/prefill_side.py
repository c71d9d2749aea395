"""The prefill half of the kvconnect SGLang manager: hold a finished request's pages, hand out its params.

SGLang calls `add_transfer_request` once per chunk of a chunked prefill; pages are only collected
until the last chunk, whose pages and aux row are then held under one kvconnect lease (the prefill
keeps them until its sender reports Success or Failed, so nothing is reused while decode reads).
The params go to every decode rank that asked for the request. The lease's end decides the
sender's status: done -> Success; aborted or expired -> Failed, with the reason sent to decode.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification
from sglang.srt.utils.network import NetworkAddress

from kvconnect.errors import KVConnectError
from kvconnect.integrations.sglang import digest, frames
from kvconnect.pd.leases import ReleaseReason

log = logging.getLogger(__name__)


def lease_id(room: int) -> str:
    """The kvconnect lease (and decode load handle) of one SGLang bootstrap room."""
    return f"sglang-{room}"


class Target:
    """One decode rank waiting for a request, in the shape SGLang's notify helpers read."""

    __slots__ = ("endpoint", "dst_port", "is_dummy")

    def __init__(self, endpoint: str, dst_port: int, is_dummy: bool):
        self.endpoint, self.dst_port, self.is_dummy = endpoint, dst_port, is_dummy


def ordered_pages(parts: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """The pages of every chunk in request order; ValueError when the chunks leave a gap or overlap."""
    parts = sorted(parts, key=lambda p: p[0])
    starts = np.array([s for s, _ in parts], dtype=np.int64)
    sizes = np.array([len(p) for _, p in parts], dtype=np.int64)
    if np.any(starts[1:] != starts[:-1] + sizes[:-1]):
        raise ValueError(f"chunks do not follow each other: starts {starts.tolist()}, sizes {sizes.tolist()}")
    return np.concatenate([p for _, p in parts]) if parts else np.zeros(0, dtype=np.int64)


class PrefillSide:
    """Mixed into the manager on a prefill server (needs `connector`, SGLang's CommonKVManager state)."""

    def _start_prefill(self) -> None:
        self._chunks: dict[int, list[tuple[int, np.ndarray]]] = {}
        self._held: dict[str, int] = {}  # lease id -> room
        self._thread = threading.Thread(target=self._serve, args=(self._on_prefill_frame,), daemon=True,
                                        name="kvconnect-sglang-prefill")
        self._thread.start()

    def _on_prefill_frame(self, msg: list[bytes]) -> None:
        head = msg[0] if msg else b""
        if head == frames.REGISTER:
            return  # pull needs none of the decode's buffer addresses
        if head == frames.META:
            m = frames.parse_meta(msg)
            if m is not None:
                infos = self.transfer_infos.setdefault(m.room, {})
                infos[f"{m.host}:{m.port}"] = Target(m.host, m.port, m.dummy)
                if len(infos) == m.required:
                    self.req_to_decode_prefix_len[m.room] = m.prefix_len
                    self.update_status(m.room, KVPoll.WaitingForInput)
            return
        note = AbortNotification.from_zmq(msg) if head == ABORT_TAG else None
        if note is None:
            log.warning("kvconnect sglang prefill: dropping an unknown frame (%d parts)", len(msg))
            return
        self.connector.abort(lease_id(note.room))
        if note.room in self.request_status:
            self.record_failure(note.room, "Aborted by the decode server")
            self.update_status(note.room, KVPoll.Failed)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: Any = None,
                             num_kv_tokens: int | None = None, **_: Any) -> None:
        """SGLang's sender, per chunk: collect the pages; at the last chunk hold them and send the params."""
        room = bootstrap_room
        if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            return
        if room not in self.transfer_infos:
            return  # no decode rank reads from this rank
        parts = self._chunks.setdefault(room, [])
        parts.append((index_slice.start or 0, np.array(kv_indices, dtype=np.int64).reshape(-1)))
        if not is_last_chunk:
            return
        del self._chunks[room]
        try:
            if aux_index is None:
                raise KVConnectError("the last chunk carries no aux row")
            pages = ordered_pages(parts)
            tokens = int(num_kv_tokens) if num_kv_tokens else int(pages.size) * int(self.kv_args.page_size)
            params = self.connector.request_finished(lease_id(room), [pages, [int(aux_index)]], tokens)
        except (KVConnectError, ValueError) as exc:
            self.conclude_failure(bootstrap_room=room, failure_reason=f"kvconnect: {exc}")
            return
        self._held[params.request_id] = room
        digest.log_digest(self.held, room, pages, int(aux_index), rank=self.attn_tp_rank)
        self.update_status(room, KVPoll.Transferring)
        msg = frames.params(room, self._prefill_unique_rank(), params)
        for host, port in self._room_notify_targets(room):
            address = NetworkAddress(host, port)
            try:
                self._send_multipart_locked(address.to_tcp(), msg, is_ipv6=address.is_ipv6)
            except Exception as exc:  # zmq errors: the decode cannot be told, so nobody will read
                self.connector.abort(params.request_id)
                self.conclude_failure(bootstrap_room=room, failure_reason=f"kvconnect: params not sent: {exc}")
                return

    def _pump_prefill(self) -> None:
        producer = self.connector.producer
        for end in producer.poll():
            room = self._held.pop(end.request_id, None)
            if room is None:
                continue
            if end.reason is ReleaseReason.DONE:
                self.update_status(room, KVPoll.Success)
                continue
            why = producer.abort_reason(end.request_id) or "no claim, done or abort in time"
            self.conclude_failure(bootstrap_room=room, failure_reason=f"kvconnect lease {end.reason.value}: {why}")

    def forget_room(self, room: int) -> None:
        """The sender was cleared: drop what was collected for it (its lease ends on its own)."""
        self._chunks.pop(room, None)
