"""Prometheus metrics, in a registry of the app's own (two apps in one process never collide)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Inference latencies from tens of microseconds to tens of seconds.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class Metrics:
    """The metrics plugserve exports at ``/metrics``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        # The *_created series only add noise to every scrape; the function is unannotated.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "plugserve_requests",
            "Inference requests answered, by route, protocol and HTTP status.",
            ["route", "protocol", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "plugserve_request_duration_seconds",
            "End-to-end time of inference requests (decode, chain, encode), by route.",
            ["route", "protocol"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe(self, route: str, protocol: str, status: int, seconds: float) -> None:
        self.requests.labels(route, protocol, str(status)).inc()
        self.latency.labels(route, protocol).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
