"""The router's own Prometheus metrics (GET /metrics of the router)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("elastic_ep_router_requests", "Requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.sent = Counter("elastic_ep_router_backend_requests", "Requests and resumed streams sent, by backend",
                            ["backend"], registry=registry)
        self.moves = Counter("elastic_ep_router_migrations",
                             "Choices moved to another instance (stream resumed, or request not started)",
                             registry=registry)
        self.rejected = Counter("elastic_ep_router_rejected", "Requests answered 429 (saturated) or 503 (no backend)",
                                ["status"], registry=registry)
        self.queued = Gauge("elastic_ep_router_queue_depth", "Requests waiting for a backend with room",
                            registry=registry)
        self.ready = Gauge("elastic_ep_router_backends_ready", "Backends ready at the last poll", registry=registry)
        self.backends = Gauge("elastic_ep_router_backends", "Backends configured", registry=registry)
        self.time_to_first_token_s = Histogram("elastic_ep_router_time_to_first_token_seconds",
                                               "From arrival at the router to the first text forwarded",
                                               buckets=_TTFT_BUCKETS_S, registry=registry)
