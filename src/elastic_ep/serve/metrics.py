"""HTTP metrics on the registry the server was given (the engine's metrics share it, so
one GET /metrics shows both).

Requests are counted by route template (`/chaos/{action}`, not the raw path) so a client
cannot grow the label set; unknown paths count as "other".
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "elastic_ep_http_requests",
            "HTTP requests by route and status",
            ["endpoint", "status"],
            registry=registry,
        )
        self.time_to_first_token_s = Histogram(
            "elastic_ep_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            buckets=_TTFT_BUCKETS_S,
            registry=registry,
        )
        self.time_per_output_token_s = Histogram(
            "elastic_ep_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request",
            buckets=_TPOT_BUCKETS_S,
            registry=registry,
        )
        self.prompt_tokens = Counter("elastic_ep_prompt_tokens", "Prompt tokens admitted", registry=registry)
        self.generation_tokens = Counter(
            "elastic_ep_generation_tokens", "Tokens generated", registry=registry
        )
        self.requests_running = Gauge(
            "elastic_ep_http_requests_running",
            "Generation requests in flight in the HTTP server",
            registry=registry,
        )


class RequestTimer:
    """Token timing of one generation request, from its arrival (before tokenization) to
    `finish`; only admitted requests count as running."""

    def __init__(self, metrics: HttpMetrics):
        self._metrics = metrics
        self._start_s = time.perf_counter()
        self._first_token_s: float | None = None
        self._last_token_s = self._start_s
        self.generated = 0

    def admit(self, prompt_tokens: int) -> None:
        self._metrics.prompt_tokens.inc(prompt_tokens)
        self._metrics.requests_running.inc()

    def tokens(self, count: int) -> None:
        if count == 0:
            return
        now_s = time.perf_counter()
        if self._first_token_s is None:
            self._first_token_s = now_s
            self._metrics.time_to_first_token_s.observe(now_s - self._start_s)
        self._last_token_s = now_s
        self.generated += count
        self._metrics.generation_tokens.inc(count)

    def finish(self) -> None:
        self._metrics.requests_running.dec()
        if self._first_token_s is not None and self.generated > 1:
            self._metrics.time_per_output_token_s.observe(
                (self._last_token_s - self._first_token_s) / (self.generated - 1)
            )


class RequestCountMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer streams and hide disconnects)."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
