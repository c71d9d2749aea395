"""Prometheus metrics of every kvconnect process, all named `kvconnect_*`.

They live in prometheus_client's default registry of the process that moves the bytes. Under vLLM
that is an engine process, not the API server that serves vLLM's /metrics: the vLLM adapter sends
them in vLLM's connector stats (counter and histogram increments, gauges' current values) and feeds
them into these same metrics in the API server (`kvconnect.integrations.vllm.prom`). `serve(port)`
exposes them from any process that calls it.
"""

from __future__ import annotations

import re

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics import MetricWrapperBase


_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

transfer_bytes = Counter("kvconnect_transfer_bytes", "Bytes pulled into this worker by completed loads",
                         ["backend"])
transfer_seconds = Histogram("kvconnect_transfer_seconds", "Seconds from posting a load to its completion",
                             ["backend"], buckets=_SECONDS)
transfer_descriptors = Histogram(
    "kvconnect_transfer_descriptors", "Block-region pairs per posted transfer (before backend coalescing)",
    ["backend"], buckets=(1, 8, 64, 512, 4096, 16384, 65536, 262144, 1048576))
handshake_seconds = Histogram("kvconnect_handshake_seconds", "Seconds to fetch and check a peer's metadata",
                              buckets=_SECONDS)
# Stages are kvconnect.pd.failure.Stage values: where in a request's life it failed (the reason goes to the log).
failures = Counter("kvconnect_failures", "Failed loads by stage", ["stage"])
transfer_errors = Counter("kvconnect_transfer_errors", "Failed loads caused by a transport error, by its kind "
                          "(unreachable, restarted, timeout, rejected, invalid, transfer)", ["kind"])
leases_held = Gauge("kvconnect_leases_held", "Requests whose blocks a producer holds for consumers")
leases_released = Counter("kvconnect_leases_released", "Producer leases ended, by how they ended", ["reason"])
offload_hits = Counter("kvconnect_offload_hits", "Blocks found in the CPU tier by lookups")
offload_misses = Counter("kvconnect_offload_misses", "Blocks not found in the CPU tier by lookups")
offload_evictions = Counter("kvconnect_offload_evictions", "Blocks evicted from the CPU tier")
tier_pages = Counter("kvconnect_offload_tier_pages", "Pages through the lower offload tiers, by tier and event "
                     "(stored, store_failed, loaded, missed, rejected)", ["tier", "event"])
# Under vLLM with several KV-cache groups, counted by the offload scheduler as it promises a hit, like its
# stats file's `group_hits`/`group_tier_hits`; `group` is the group's index in vLLM's KV-cache config.
offload_group_hits = Counter("kvconnect_offload_group_hits", "Blocks offload hits took from the tiers, by KV-cache "
                             "group (its index in vLLM's KV-cache config)", ["group"])
offload_group_tier_hits = Counter(
    "kvconnect_offload_group_tier_hits", "Of the blocks offload hits took, those brought up from a lower tier "
    "(disk, store), by KV-cache group (its index in vLLM's KV-cache config)", ["group"])
# Under vLLM, from the offload workers' connector stats (TP rank 0); their difference is the time loads saved.
offload_load_seconds = Counter("kvconnect_offload_load_seconds", "Seconds offload loads took, start to usable blocks")
offload_recompute_est_seconds = Counter(
    "kvconnect_offload_recompute_est_seconds",
    "Estimated seconds the engine would have spent computing the tokens offload loads brought (its measured rate)")


# Every metric defined above, and only those: collecting the whole default registry every engine step
# also ran the process collector (a listing of /proc/self/fd and friends) about a thousand times a
# second while blocks were held. Derived, so that a metric added above is never left out of snapshot().
_OURS = tuple(m for m in list(globals().values()) if isinstance(m, MetricWrapperBase))


# Each metric by its name (without a counter's `_total`), and its type: "counter", "gauge" or "histogram".
BY_NAME = {m.describe()[0].name: m for m in _OURS}
KINDS = {name: m.describe()[0].type for name, m in BY_NAME.items()}
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_sum", "_count", "_bucket")}
_SAMPLE = re.compile(r"([a-z_]+)(?:\{([^{}]*)\})?")


def parse_sample(key: str) -> tuple[MetricWrapperBase, str, dict[str, str]] | None:
    """A `snapshot()` key as (metric, sample suffix, labels); None unless it names one of our samples exactly."""
    m = _SAMPLE.fullmatch(key)
    if not m:
        return None
    name, body = m.group(1), m.group(2)
    for base, metric in BY_NAME.items():
        suffix = name[len(base):]
        if name.startswith(base) and suffix in _SUFFIXES[KINDS[base]]:
            break
    else:
        return None
    pairs = [p.split("=", 1) for p in body.split(",")] if body else []
    labels = {p[0]: p[1] for p in pairs if len(p) == 2}
    want = set(metric._labelnames) | ({"le"} if suffix == "_bucket" else set())
    return (metric, suffix, labels) if len(labels) == len(pairs) and set(labels) == want else None


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Serve every metric over HTTP for a worker that has no /metrics of its own (loopback by default)."""
    start_http_server(port, addr=addr)


def value(name: str, labels: dict[str, str] | None = None) -> float:
    """The current value of one sample (`name` as exposed, e.g. `kvconnect_transfer_bytes_total`), or 0."""
    got = REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if got is None else float(got)


def snapshot() -> dict[str, float]:
    """Every kvconnect sample as {name{labels}: value}, for engines that report stats their own way."""
    out: dict[str, float] = {}
    for family in (f for metric in _OURS for f in metric.collect()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = float(s.value)
    return out
