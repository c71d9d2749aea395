"""Counters our vLLM connectors report: through vLLM's connector stats each step, and to a JSON file.

Under vLLM, kvconnect's Prometheus metrics live in engine processes, not in the API server whose
/metrics an operator scrapes. `ProcessMetrics` turns them into stats that ride in vLLM's connector
stats: counter and histogram samples as increments (summed across steps and workers), gauges as this
process's current value under `name@source` (the latest wins per source; sources add up), so a gauge
is never a sum of steps. `kvconnect.integrations.vllm.prom` feeds them into the API server's metrics.
`StatsFile` writes a dict atomically whenever it changes, for operators and tests to read.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvconnect import metrics

AT = "@"  # "sample@source": a metric sample of one process (host:pid)


def source() -> str:
    """This process, as the stats name it (read at each call: a forked child is another source)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def is_gauge(key: str) -> bool:
    """Whether a stats key is a gauge sample (its current value, not an increment)."""
    return metrics.KINDS.get(key.split("{", 1)[0].split(AT, 1)[0]) == "gauge"


@dataclass
class KVConnectStats(KVConnectorStats):
    """What workers (and the scheduler's process) report each step; vLLM merges them across workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = v if is_gauge(k) else self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """One value per sample for vLLM's log line: sources added up, histogram buckets left out."""
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            name = k.split(AT, 1)[0]
            if "_bucket{" not in name:
                out[name] = out.get(name, 0) + v
        return out

    def is_empty(self) -> bool:
        return not any(v or is_gauge(k) for k, v in self.data.items())


class ProcessMetrics:
    """kvconnect's metrics of this process as stats, taken once per process whichever connector half asks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}

    def take(self) -> dict[str, float]:
        """Counter and histogram increments since the last call, and every gauge that changed, keyed `sample@source`."""
        here = source()
        with self._lock:  # two takers at once would both report the same increments
            now = metrics.snapshot()
            seen, self._seen = self._seen, now
        out = {}
        for k, v in now.items():
            old = seen.get(k, 0.0)
            if v != old:
                out[f"{k}{AT}{here}"] = v if is_gauge(k) else v - old
        return out


PROCESS_METRICS = ProcessMetrics()


class StepStats:
    """What a worker accumulates between two `get_kv_connector_stats` calls."""

    def __init__(self, with_metrics: bool):
        self._with_metrics = with_metrics
        self._pending = KVConnectStats()

    def add(self, **counts: int | float) -> None:
        """Count events of this step (zero counts are dropped)."""
        data = {k: v for k, v in counts.items() if v}
        if data:
            self._pending.aggregate(KVConnectStats(data=data))

    def take(self) -> KVConnectStats | None:
        """Everything since the last call, this process's kvconnect metrics included; None if nothing."""
        if self._with_metrics:
            self._pending.aggregate(KVConnectStats(data=PROCESS_METRICS.take()))
        if self._pending.is_empty():
            return None
        out, self._pending = self._pending, KVConnectStats()
        return out


def scheduler_stats() -> KVConnectStats | None:
    """The scheduler half's report: its process's kvconnect metrics (the offload tier's lookups live there)."""
    data = PROCESS_METRICS.take()
    return KVConnectStats(data=data) if data else None


class StatsFile:
    """A JSON file rewritten atomically (write, then rename) whenever the dict changes."""

    def __init__(self, path: str | None):
        self.path = path
        self._last: dict[str, Any] | None = None

    def write(self, stats: dict[str, Any]) -> None:
        """Write `stats` if they differ from what was written last (no-op without a path)."""
        if not self.path or stats == self._last:
            return
        self._last = dict(stats)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, self.path)
