"""A decode rank's params for one room, gathered from every prefill rank into the one load that reads them,
and which prefill layouts a decode pairs with at all (`unpaired`).

With kvconnect's backend every decode rank asks every prefill attention-TP rank for a room (the
manager's rank mapping), and each prefill rank answers with the params of its own lease. Once all of
them arrived they are combined in rank order (`kvconnect.pd.producer.combine_ranks`): the core then
reads from each prefill rank the heads this decode rank holds (all of them, part, or none) and tells
each rank it read that it is done. Engine-free, so the rules are tested without SGLang.

Params that cannot be combined (a rank twice, a rank outside the prefill's TP size, ranks naming
other blocks) fail the room and are not released one by one: their leases run out. A room whose
ranks never all arrive (a prefill rank died) is forgotten after `max_age_s`, by then its leases ended.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvconnect import wire
from kvconnect.pd.producer import combine_ranks


@dataclass(frozen=True)
class Gathered:
    """What one arriving params frame completed: the combined params, or why the room cannot be read."""

    params: wire.TransferParams | None = None
    error: str = ""


class RankParams:
    """Per room, the params received so far by prefill rank; thread-safe (SGLang's socket thread adds,
    its scheduler thread drops)."""

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._rooms: dict[int, tuple[float, dict[int, wire.TransferParams]]] = {}

    def add(self, room: int, rank: int, params: wire.TransferParams, ranks: int) -> Gathered | None:
        """Note rank `rank`'s params of `ranks` prefill ranks; None while some are still to come."""
        now = self._clock()
        with self._lock:
            self._forget_older_than(now - self.max_age_s)
            got = self._rooms.setdefault(room, (now, {}))[1]
            if not 0 <= rank < ranks or rank in got:
                self._rooms.pop(room, None)
                return Gathered(error=f"prefill rank {rank} sent params twice" if rank in got else
                                f"params from prefill rank {rank}, the prefill runs {ranks} attention TP rank(s)")
            got[rank] = params
            if len(got) < ranks:
                return None
            del self._rooms[room]
        try:
            return Gathered(params=combine_ranks([got[r] for r in range(ranks)]))
        except wire.WireError as exc:
            return Gathered(error=f"the prefill ranks' params do not agree: {exc}")

    def drop(self, room: int) -> None:
        """Forget a room (its decode gave up; the leases of params received run out)."""
        with self._lock:
            self._rooms.pop(room, None)

    def _forget_older_than(self, t: float) -> None:
        # Rooms are added in time order (dicts keep insertion order): stop at the first young one.
        while self._rooms:
            room, (added, _) = next(iter(self._rooms.items()))
            if added > t:
                return
            del self._rooms[room]

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)


def unpaired(info: Any, tp: int, split_by_head: bool) -> str:
    """Why kvconnect does not pair this decode (attention TP `tp`) with a prefill of SGLang's parallel
    layout `info`; "" when it does."""
    if int(getattr(info, "pp_size", 1) or 1) != 1 or int(getattr(info, "attn_cp_size", 1) or 1) != 1:
        return (f"it runs pipeline parallel {info.pp_size} and context parallel {info.attn_cp_size}; kvconnect "
                "pairs attention TP ranks only")
    if int(info.attn_tp_size) != tp and not split_by_head:
        return (f"it runs attention TP {info.attn_tp_size}, this decode {tp}, and these pages do not split by "
                "head (MLA): kvconnect pairs equal TP sizes only")
    return ""
