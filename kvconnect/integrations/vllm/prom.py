"""kvconnect's metrics on vLLM's /metrics: the API server feeds what engine processes report into them.

vLLM hands every step's connector stats to the API server process and asks the connector class for a
`KVConnectorPromMetrics` to record them (`build_prom_metrics`). Ours writes them into kvconnect's own
metrics (`kvconnect.metrics`, the default registry that vLLM's /metrics serves), so the names, types
and labels are those of every other kvconnect process: counters and histograms grow by the reported
increments, a gauge is set to the sum of each engine process's latest value. Samples from this very
process are skipped (it counts them live), and so is anything that is not one of our samples, except
the offload workers' load timings (`_WORKER_COUNTERS`), which are counts of theirs rather than samples.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvconnect import metrics
from kvconnect.integrations.vllm.stats import AT, source

if TYPE_CHECKING:
    from vllm.config import VllmConfig


# Offload worker counts (plain keys, summed over steps) that feed a counter of ours.
_WORKER_COUNTERS = {"load_seconds": metrics.offload_load_seconds,
                    "load_recompute_seconds_est": metrics.offload_recompute_est_seconds}


class KVConnectProm(KVConnectorPromMetrics):
    """Records kvconnect's connector stats into kvconnect's Prometheus metrics in vLLM's API server."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._here = source()
        self._gauges: dict[str, dict[str, float]] = {}  # gauge sample -> {source: its latest value}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's increments and gauge values (engines are added up, not labelled)."""
        buckets: dict[tuple[Any, tuple], dict[float, float]] = {}
        for key, value in (transfer_stats_data or {}).items():
            if key in _WORKER_COUNTERS and isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
                _WORKER_COUNTERS[key].inc(value)
            sample, _, src = str(key).rpartition(AT)
            if not sample or src == self._here or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue  # an event count (loads_ok...), a sample counted live here, or not a number
            parsed = metrics.parse_sample(sample)
            if parsed is None:
                continue
            metric, suffix, labels = parsed
            if suffix == "":
                values = self._gauges.setdefault(sample, {})
                values[src] = float(value)
                _child(metric, labels).set(sum(values.values()))
            elif value <= 0:
                continue  # increments only; a counter never goes down
            elif suffix == "_total":
                _child(metric, labels).inc(value)
            elif suffix == "_sum":
                _child(metric, labels)._sum.inc(value)
            elif suffix == "_bucket" and (le := _bound(labels.pop("le"))) is not None:
                buckets.setdefault((metric, tuple(sorted(labels.items()))), {})[le] = float(value)
            # `_count` is the +Inf bucket: it grows with the buckets.
        for (metric, labels), cumulative in buckets.items():
            _add_buckets(_child(metric, dict(labels)), cumulative)


def _bound(le: str) -> float | None:
    try:
        return float(le)
    except ValueError:
        return None


def _child(metric: Any, labels: dict[str, str]) -> Any:
    return metric.labels(**labels) if labels else metric


def _add_buckets(child: Any, cumulative: dict[float, float]) -> None:
    """Add increments of cumulative bucket counts (`le` -> count) to a histogram's own (per-bucket) counts."""
    below = 0.0
    for i, bound in enumerate(child._upper_bounds):
        at = cumulative.get(bound, 0.0)  # an absent `le` did not change: no observation at or below it
        if at > below:
            child._buckets[i].inc(at - below)
        below = max(below, at)
