"""The offload workers' per-rank reports, as the scheduler acts on them: a job is done once every rank is.

Under tensor parallelism each rank's worker runs the same store orders on its own shard and reports
each one in its own worker meta, and vLLM merges the ranks' metas (`KVConnectWorkerMeta.aggregate`)
in whatever step each rank got there. A boundary state is published only once every rank holds its
shard of it (a hit loads on every rank), and a stored block's slots may be reused only once every
rank is done reading them for its write-down. `RankReports` counts the ranks per job and hands the
scheduler each job once, in the step its last rank reported.
"""

from __future__ import annotations

from typing import Iterator

from kvconnect.integrations.vllm.meta import KVConnectWorkerMeta


class RankReports:
    """Which ranks reported each store job copied, or written down; a job is yielded once all `tp` have."""

    def __init__(self, tp: int):
        self.tp = tp
        self._stored_by: dict[str, set[int]] = {}  # boundary-state store job -> ranks that copied it
        self._written_by: dict[str, set[int]] = {}  # store job -> ranks done with its slots
        self._failed: set[str] = set()  # boundary-state store jobs a rank failed

    def states_stored(self, meta: KVConnectWorkerMeta) -> Iterator[tuple[str, bool]]:
        """(job, failed on some rank) per boundary-state store every rank has now run."""
        for job, rank in meta.stored:
            if job in meta.failed_stores:
                self._failed.add(job)
            if self._every_rank(self._stored_by, job, rank):
                failed = job in self._failed
                self._failed.discard(job)
                yield job, failed

    def written_down(self, meta: KVConnectWorkerMeta) -> Iterator[str]:
        """Each store job whose slots no rank reads any more (written down, or its store failed)."""
        for job, rank in meta.written_down:
            if self._every_rank(self._written_by, job, rank):
                yield job

    def _every_rank(self, seen: dict[str, set[int]], job: str, rank: int) -> bool:
        """Note that `rank` reported `job`; True, and the job forgotten, once every TP rank has."""
        ranks = seen.setdefault(job, set())
        ranks.add(rank)
        if len(ranks) < self.tp:
            return False
        del seen[job]
        return True
