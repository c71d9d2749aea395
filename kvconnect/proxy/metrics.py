"""The router's Prometheus series, in a registry of its own so that its /metrics shows exactly these."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvconnect.proxy.pool import Pool


class RouterMetrics:
    """The router's own Prometheus registry, so that /metrics shows exactly the router's series."""

    def __init__(self, pools: list[Pool]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvconnect_proxy_requests", "Client requests by route and HTTP status",
                                ["route", "code"], registry=r)
        self.seconds = Histogram("kvconnect_proxy_request_seconds", "Client request time, to the last byte",
                                 ["route"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        self.prefill_seconds = Histogram("kvconnect_proxy_prefill_seconds",
                                         "Prefill step time, until transfer params are back", registry=r,
                                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.failures = Counter("kvconnect_proxy_upstream_failures", "Failed calls to instances",
                                ["role", "instance", "reason"], registry=r)
        outstanding = Gauge("kvconnect_proxy_outstanding", "Requests in flight per instance",
                            ["role", "instance"], registry=r)
        up = Gauge("kvconnect_proxy_instance_up", "1 when the instance's last probe or call succeeded",
                   ["role", "instance"], registry=r)
        for pool in pools:
            for inst in pool.instances:
                outstanding.labels(pool.role, inst.url).set_function(lambda i=inst: i.outstanding)
                up.labels(pool.role, inst.url).set_function(lambda i=inst: float(i.up))
