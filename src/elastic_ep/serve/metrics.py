"""HTTP metrics on the registry the server was given (the engine's metrics share it, so
one GET /metrics shows both).

Requests are counted by route template (`/chaos/{action}`, not the raw path) so a client
cannot grow the label set; unknown paths count as "other". The request metrics mean what vLLM's
of the same name mean (`vllm:e2e_request_latency_seconds`, `vllm:request_success_total`, ...;
the table is in docs/RUNBOOK.md) and carry its `model_name` label, so its dashboards apply.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
# vLLM's finished reasons; "error" is a request the engine could not finish (its stream ended with an error)
FINISHED_REASONS = ("stop", "length", "abort", "error")


class HttpMetrics:
    """model_name: the served model name, the `model_name` label of the request metrics."""

    def __init__(self, registry: CollectorRegistry, model_name: str = ""):
        self.requests = Counter(
            "elastic_ep_http_requests",
            "HTTP requests by route and status",
            ["endpoint", "status"],
            registry=registry,
        )
        model = ["model_name"]
        self.time_to_first_token_s = Histogram(
            "elastic_ep_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            model, buckets=_TTFT_BUCKETS_S, registry=registry,
        ).labels(model_name)
        self.time_per_output_token_s = Histogram(
            "elastic_ep_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request",
            model, buckets=_TPOT_BUCKETS_S, registry=registry,
        ).labels(model_name)
        self.e2e_request_latency_s = Histogram(
            "elastic_ep_e2e_request_latency_seconds",
            "From request arrival to its end (finished, aborted or failed), per generation request",
            model, buckets=_E2E_BUCKETS_S, registry=registry,
        ).labels(model_name)
        self._model_name = model_name
        self._success = Counter(
            "elastic_ep_request_success", "Generation requests that ended, by finished_reason (stop, length, "
            "abort: the client went away, error: the engine could not finish it)",
            ["model_name", "finished_reason"], registry=registry,
        )
        for reason in FINISHED_REASONS:
            self._success.labels(model_name, reason)
        self.prompt_tokens = Counter("elastic_ep_prompt_tokens", "Prompt tokens admitted", model,
                                     registry=registry).labels(model_name)
        self.generation_tokens = Counter(
            "elastic_ep_generation_tokens", "Tokens generated", model, registry=registry
        ).labels(model_name)
        self.requests_running = Gauge(
            "elastic_ep_http_requests_running",
            "Generation requests in flight in the HTTP server",
            model, registry=registry,
            multiprocess_mode="livesum",  # behind --api-server-count N: summed over the live servers
        ).labels(model_name)

    def request_success(self, finished_reason: str) -> Counter:
        return self._success.labels(self._model_name, finished_reason)


class RequestTimer:
    """Token timing of one generation request, from its arrival (before tokenization) to
    `finish`; only admitted requests count as running."""

    def __init__(self, metrics: HttpMetrics):
        self._metrics = metrics
        self._start_s = time.perf_counter()
        self._first_token_s: float | None = None
        self._last_token_s = self._start_s
        self.generated = 0
        self.finished_reason = "abort"  # until the engine says how it ended

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

    def ended(self, finished_reason: str) -> None:
        """How the request ended (a value of FINISHED_REASONS); counted at `finish`."""
        self.finished_reason = finished_reason

    def finish(self) -> None:
        """The request is over: counted by its finished reason ("abort" unless `ended` said otherwise)."""
        m = self._metrics
        m.requests_running.dec()
        m.e2e_request_latency_s.observe(time.perf_counter() - self._start_s)
        m.request_success(self.finished_reason).inc()
        if self._first_token_s is not None and self.generated > 1:
            m.time_per_output_token_s.observe(
                (self._last_token_s - self._first_token_s) / (self.generated - 1)
            )


# The scope key a forwarding route sets to the route that answered elsewhere (serve/proxy.py)
ROUTED_AS = "elastic_ep.routed_as"


def route_template(scope: Scope) -> str | None:
    """The path template of the route that took the request, once routed."""
    return getattr(scope.get("route"), "path", None)


class RequestCountMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer streams and hide disconnects).
    Requests are counted by route template (`ROUTED_AS` where a route forwarded the request)."""

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
            endpoint = scope.get(ROUTED_AS) or route_template(scope) or "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
