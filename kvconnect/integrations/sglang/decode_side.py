"""The decode half of the kvconnect SGLang manager: pull a request's pages once its params arrive.

SGLang's receiver tells the prefill where to send the params (`build_receiver_metadata_message`);
the pages and aux row it allocated stay here, by room. Every decode rank asks every prefill
attention-TP rank (`_resolve_rank_mapping`), so the params of all prefill ranks arrive; once they
did, the load starts (`KVConnector.start_load`: handshake, claim, READs of the heads this rank holds
from each prefill rank that holds them, done notices, all bounded); its result sets the room's
status. A load that cannot start releases the prefill's leases at once.

An aborted or failed request's pages go back to SGLang only once its load ended: SGLang holds them
(its deferred KV release, see `deferral`) until `is_abort_release_safe` says kvconnect reported the
load finished or failed, which it does only once nothing more can land in them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from sglang.srt.disaggregation.base.conn import KVPoll

from kvconnect import wire
from kvconnect.errors import KVConnectError
from kvconnect.integrations.sglang import digest, faults, frames
from kvconnect.integrations.sglang.gather import RankParams, unpaired
from kvconnect.integrations.sglang.prefill_side import lease_id

log = logging.getLogger(__name__)


class DecodeSide:
    """Mixed into the manager on a decode server (needs `connector`, SGLang's CommonKVManager state)."""

    def _start_decode(self) -> None:
        self._dests: dict[int, tuple[np.ndarray, int]] = {}  # room -> (pages, aux row)
        self._loads: dict[str, tuple[int, np.ndarray, int]] = {}  # load handle -> (room, pages, aux row)
        self._sources: dict[int, frozenset[str]] = {}  # room -> the prefill ranks' hosts SGLang's bootstrap named
        self._refused: set[str] = set()  # prefill bootstrap addresses of a layout kvconnect does not pair
        # Params of every prefill rank, per room, until all arrived (forgotten once their leases ran out).
        self._gather = RankParams(max_age_s=self.connector.config.lease_s + self.connector.config.load_timeout_s)
        # Held across a room's check and its load's start, so an abort sees either no load or one it can cancel.
        self._rooms_lock = threading.Lock()
        self._delay_s, self._hold_s = faults.load_delay_s(), faults.read_hold_s()
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

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's fetch of the prefill's parallel layout; a layout kvconnect cannot pair with reads as none.

        Attention TP sizes may differ (the pages split by head); pipeline and context parallel prefills
        are not paired. Such a prefill is logged and left out of SGLang's table, so SGLang's bounded
        retries end its requests aborted (raising here would stop the decode server over one request's
        prefill).
        """
        if not super().try_ensure_parallel_info(bootstrap_addr):
            return False
        info = self.prefill_info_table[bootstrap_addr]
        why = unpaired(info, self.attn_tp_size, self.held.heads is not None)
        if not why:
            return True
        del self.prefill_info_table[bootstrap_addr]
        if bootstrap_addr not in self._refused:  # SGLang asks again every second until it gives up
            self._refused.add(bootstrap_addr)
            log.error("kvconnect sglang decode: prefill %s: %s: its requests fail", bootstrap_addr, why)
        return False

    def _resolve_rank_mapping(self, info: Any) -> None:
        """Every decode rank asks every prefill attention-TP rank: kvconnect reads each rank's heads
        from whichever prefill ranks hold them, so it needs the params of all of them."""
        super()._resolve_rank_mapping(info)
        info.target_tp_rank = None
        info.target_tp_ranks = list(range(int(info.attn_tp_size)))
        info.required_dst_info_num = int(self.attn_tp_size)
        info.required_prefill_response_num = int(info.attn_tp_size)

    def expect_params_from(self, room: int, hosts: frozenset[str]) -> None:
        """The room's params must name these hosts only (its prefill ranks, as SGLang's bootstrap gave them)."""
        self._sources[room] = hosts

    def _on_decode_frame(self, msg: list[bytes]) -> None:
        if msg and msg[0] == frames.PARAMS:
            got = frames.parse_params(msg)
            if got is not None:
                self._on_params(*got)
            return
        parsed = self.parse_kv_status_message(msg)
        if parsed is not None:
            room, status, rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason)

    def _on_params(self, room: int, rank: int, params: wire.TransferParams) -> None:
        """One prefill rank's params; the load starts once every rank's arrived."""
        ranks = self.required_prefill_response_num_table.get(room)
        got = self._gather.add(room, rank, params, int(ranks or 1))
        if got is None:
            return
        if got.error:
            log.warning("kvconnect sglang decode: room %s: %s", room, got.error)
            with self._rooms_lock:
                self._dests.pop(room, None)
                self._sources.pop(room, None)
                self._fail_room(room, got.error)
            return
        if self._delay_s > 0:
            log.warning("kvconnect sglang decode: fault injection: room %s read in %g s", room, self._delay_s)
            time.sleep(self._delay_s)
        self._start_load(room, got.params)

    def _start_load(self, room: int, params: wire.TransferParams) -> None:
        with self._rooms_lock:
            sources = self._sources.pop(room, frozenset())
            foreign = frames.foreign_hosts(params, sources)
            dest = self._dests.pop(room, None)
            if foreign:
                # Neither read nor released: the named host is not the room's prefill, so nothing goes to it.
                log.warning("kvconnect sglang decode: params for room %s name host(s) %s, SGLang's bootstrap named "
                            "%s: refused", room, foreign, sorted(sources))
                if dest is not None:
                    self._fail_room(room, f"params name prefill host(s) {foreign}, not the bootstrapped prefill's")
                return
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
                self._fail_room(room, f"load refused: {exc}")
                self._release(params)
                return
        if self._hold_s > 0:
            log.warning("kvconnect sglang decode: fault injection: room %s READ held %g s", room, self._hold_s)
        self.update_status(room, KVPoll.Transferring)

    def _fail_room(self, room: int, why: object) -> None:
        # A room SGLang already cleared is left alone: a failure recorded for it would be kept forever.
        if room in self.request_status:
            self.record_failure(room, f"kvconnect: {why}")
            self.update_status(room, KVPoll.Failed)

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
                digest.log_digest(self.held, *load, rank=self.attn_tp_rank)
                self.update_status(load[0], KVPoll.Success)
        for handle, failure in done.failed.items():
            room = self._loads.pop(handle, (None,))[0]
            if room is not None:
                log.warning("kvconnect sglang decode: room %s failed: kvconnect: %s", room, failure)
                self._fail_room(room, failure)

    def abort_load(self, room: int) -> None:
        """The receiver gave up: forget the room's pages and fail its load if one runs."""
        self._gather.drop(room)
        with self._rooms_lock:
            self._dests.pop(room, None)
            self._sources.pop(room, None)
            running = lease_id(room) in self._loads
        if running:
            self.connector.abort(lease_id(room))

    def load_running(self, room: int) -> bool:
        """Whether a kvconnect load may still write the room's pages (not yet reported loaded or failed)."""
        self.pump()
        with self._rooms_lock:
            return lease_id(room) in self._loads

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """SGLang may free an aborted room's pages: its load, if any, ended (prefill acks are not needed)."""
        return not self.load_running(bootstrap_room)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang freed a held room's pages: say whether that was safe (its own timeout frees them regardless)."""
        super().clear_deferred_abort_state(bootstrap_room)
        if self.load_running(bootstrap_room):
            log.error("kvconnect sglang decode: room %s pages released while its kvconnect load can still land "
                      "bytes in them (SGLang's deferred KV release timed out first)", bootstrap_room)
        else:
            log.info("kvconnect sglang decode: room %s pages released after its load ended", bootstrap_room)
