"""Counters our vLLM connectors report: through vLLM's connector stats each step, and to a JSON file.

Under vLLM, kvconnect's Prometheus metrics live in the engine-core process, which vLLM's /metrics does
not show; `MetricDeltas` turns them into per-step increments that ride in vLLM's connector stats.
`StatsFile` writes a dict atomically whenever it changes, for operators and tests to read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvconnect import metrics


@dataclass
class KVConnectStats(KVConnectorStats):
    """Counters a worker reports each step; vLLM sums them across workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StepStats:
    """What a worker accumulates between two `get_kv_connector_stats` calls."""

    def __init__(self, with_metrics: bool):
        self._with_metrics = with_metrics
        self._seen: dict[str, float] = {}
        self._pending = KVConnectStats()

    def add(self, **counts: int) -> None:
        """Count events of this step (zero counts are dropped)."""
        data = {k: v for k, v in counts.items() if v}
        if data:
            self._pending.aggregate(KVConnectStats(data=data))

    def take(self) -> KVConnectStats | None:
        """Everything since the last call, kvconnect's Prometheus increments included; None if nothing."""
        if self._with_metrics:
            now = {k: v for k, v in metrics.snapshot().items() if "_bucket" not in k}
            delta = {k: v - self._seen.get(k, 0.0) for k, v in now.items() if v != self._seen.get(k, 0.0)}
            self._seen = now
            self._pending.aggregate(KVConnectStats(data=delta))
        if self._pending.is_empty():
            return None
        out, self._pending = self._pending, KVConnectStats()
        return out


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
