"""The decode half of the kvconnect SGLang manager: pull a request's pages once its params arrive.

SGLang's receiver tells the prefill where to send the params (`build_receiver_metadata_message`);
the pages and aux row it allocated stay here, by room. When the params arrive the load starts
(`KVConnector.start_load`: handshake, claim, READs, done notice, all bounded); its result sets the
room's status. A load that cannot start releases the prefill's lease at once.

Fault injection: `KVCONNECT_SGLANG_FAULT_LOAD_DELAY_S` makes the decode wait that long between
receiving a request's params and reading it (a prefill can then die in between, as in the e2e).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from sglang.srt.disaggregation.base.conn import KVPoll

from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.integrations.sglang import digest, frames
from kvconnect.integrations.sglang.prefill_side import lease_id

log = logging.getLogger(__name__)


class DecodeSide:
    """Mixed into the manager on a decode server (needs `connector`, SGLang's CommonKVManager state)."""

    def _start_decode(self) -> None:
        self._dests: dict[int, tuple[np.ndarray, int]] = {}  # room -> (pages, aux row)
        self._loads: dict[str, tuple[int, np.ndarray, int]] = {}  # load handle -> (room, pages, aux row)
        self._delay_s = float(os.environ.get("KVCONNECT_SGLANG_FAULT_LOAD_DELAY_S", "0"))
        self._thread = threading.Thread(target=self._serve, args=(self._on_decode_frame,), daemon=True,
                                        name="kvconnect-sglang-decode")
        self._thread.start()
        self._start_heartbeat_checker_thread()

    def build_receiver_registration_message(self) -> list[bytes]:
        """Sent once per prefill rank by SGLang's receiver."""
        return frames.register(self.local_ip, self.rank_port)

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int, kv_indices: Any,
                                        aux_index: int | None, state_indices: Any, decode_prefix_len: int | None,
                                        is_dummy: bool, device_kv_indices: Any = None) -> list[bytes]:
        """Remember where the request's pages go; tell the prefill where to send its params."""
        if not is_dummy:
            self._dests[bootstrap_room] = (np.array(kv_indices, dtype=np.int64).reshape(-1), int(aux_index))
        return frames.meta(frames.Meta(room=bootstrap_room, host=self.local_ip, port=self.rank_port,
                                       required=required_dst_info_num, prefix_len=int(decode_prefix_len or 0),
                                       dummy=is_dummy))

    def _on_decode_frame(self, msg: list[bytes]) -> None:
        if msg and msg[0] == frames.PARAMS:
            got = frames.parse_params(msg)
            if got is not None:
                if self._delay_s > 0:
                    log.warning("kvconnect sglang decode: fault injection: room %s read in %g s", got[0], self._delay_s)
                    time.sleep(self._delay_s)
                self._start_load(got[0], got[2])
            return
        parsed = self.parse_kv_status_message(msg)
        if parsed is not None:
            room, status, rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason)

    def _start_load(self, room: int, params: wire.TransferParams) -> None:
        dest = self._dests.pop(room, None)
        if dest is None or room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            log.info("kvconnect sglang decode: params for room %s, which waits for none: lease released", room)
            self._release(params)
            return
        pages, aux = dest
        handle = lease_id(room)
        # Known before the load starts: a pump on the scheduler's thread may see it finish at once.
        self._loads[handle] = (room, pages, aux)
        try:
            self.connector.start_load(params, [pages, [aux]], handle=handle, decoded=True)
        except KVConnectError as exc:
            self._loads.pop(handle, None)
            self.record_failure(room, f"kvconnect: load refused: {exc}")
            self.update_status(room, KVPoll.Failed)
            self._release(params)
            return
        self.update_status(room, KVPoll.Transferring)

    def _release(self, params: wire.TransferParams) -> None:
        try:
            self.connector.release_remote(params, decoded=True)
        except KVConnectError as exc:
            log.warning("kvconnect sglang decode: could not release %s: %s", params.request_id, exc)

    def _pump_decode(self) -> None:
        done = self.connector.get_finished()
        for handle in done.loaded:
            load = self._loads.pop(handle, None)
            if load is not None:
                digest.log_digest(self.held, *load)
                self.update_status(load[0], KVPoll.Success)
        for handle, failure in done.failed.items():
            room = self._loads.pop(handle, (None,))[0]
            if room is not None:
                log.warning("kvconnect sglang decode: room %s failed: kvconnect: %s", room, failure)
                self.record_failure(room, f"kvconnect: {failure}")
                self.update_status(room, KVPoll.Failed)

    def abort_load(self, room: int) -> None:
        """The receiver gave up: forget the room's pages and fail its load if one runs."""
        self._dests.pop(room, None)
        if lease_id(room) in self._loads:
            self.connector.abort(lease_id(room))
