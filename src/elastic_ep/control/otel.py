"""The OpenTelemetry side of control/tracing.py: turns a finished request's record into spans and
exports them over OTLP/HTTP (protobuf). The only module that imports the SDK; loaded only when
`--otlp-traces-endpoint` is set (the optional extra `elastic-ep[tracing]`).

The standard variables apply: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (the resource),
OTEL_EXPORTER_OTLP_TRACES_HEADERS / _TIMEOUT / _COMPRESSION / _CERTIFICATE (the exporter),
OTEL_BSP_* (the batch processor: queue size, delay, batch size).

The control thread only queues a finished record (`request`, `epoch`); a thread of this sink makes
the spans (about a millisecond per request with the SDK) and the batch processor's thread exports
them. A collector that is down or slow, or more sampled requests than the sink keeps up with,
cost dropped traces (`dropped`, beyond `MAX_QUEUED` waiting), never a step.
"""

from __future__ import annotations

import os
import queue
import threading
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from .tracing import EpochSpan, RequestTrace

MAX_QUEUED = 10_000  # finished records waiting for their spans; more are dropped


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: `endpoint` as given, with /v1/traces when it names no path."""
    return endpoint if urlparse(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class OtelSink:
    """exporter: where spans go; batch: make spans on this sink's thread and export them from the
    batch processor's (False: both at once in the caller, for tests)."""

    def __init__(self, exporter: SpanExporter, service_name: str = "elastic-ep", model_name: str = "",
                 batch: bool = True):
        # OTEL_SERVICE_NAME, when set, names the service; else ours
        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("elastic_ep")
        self.model_name = model_name
        self.dropped = 0
        self._queue: queue.Queue | None = queue.Queue(MAX_QUEUED) if batch else None
        self._thread = threading.Thread(target=self._run, name="trace-spans", daemon=True) if batch else None
        if self._thread is not None:
            self._thread.start()

    @classmethod
    def to_endpoint(cls, endpoint: str, service_name: str = "elastic-ep", model_name: str = "") -> OtelSink:
        return cls(OTLPSpanExporter(endpoint=traces_url(endpoint)), service_name, model_name)

    def request(self, t: RequestTrace) -> None:
        self._submit(self._request_spans, t)

    def epoch(self, e: EpochSpan) -> None:
        self._submit(self._epoch_span, e)

    def shutdown(self) -> None:
        """Make the spans still queued, export everything, stop."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(10)
        self.provider.shutdown()

    def _submit(self, make, record) -> None:
        if self._queue is None:
            make(record)
            return
        try:
            self._queue.put_nowait((make, record))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            make, record = item
            make(record)

    def _request_spans(self, t: RequestTrace) -> None:
        root = self.tracer.start_span("llm_request", start_time=t.arrival_ns, kind=trace.SpanKind.SERVER,
                                      attributes=t.attributes(self.model_name))
        context = trace.set_span_in_context(root)

        def child(name: str, start_ns: int, end_ns: int, attributes: dict) -> None:
            span = self.tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)
            span.end(end_time=max(end_ns, start_ns))

        end = t.end_ns
        child("queue", t.arrival_ns, t.scheduled_ns or end, {})
        if t.scheduled_ns:
            child("prefill", t.scheduled_ns, t.first_token_ns or end,
                  {"elastic_ep.rank": t.ranks[0] if t.ranks else -1, "gen_ai.usage.prompt_tokens": t.prompt_tokens})
        if t.first_token_ns:
            attributes = {"gen_ai.usage.completion_tokens": t.output_tokens,
                          "elastic_ep.rank": t.ranks[-1] if t.ranks else -1}
            if t.waited_on:
                rank, steps = t.waited_on.most_common(1)[0]
                attributes |= {"elastic_ep.waited_on_rank": rank,
                               "elastic_ep.waited_on_share": steps / sum(t.waited_on.values())}
            child("decode", t.first_token_ns, end, attributes)
        for p in t.pauses:
            child("recovery_pause", max(p.start_ns, t.arrival_ns), min(p.end_ns or end, end),
                  {"elastic_ep.cause": p.cause, "elastic_ep.culprits": p.culprits, "elastic_ep.evicted": p.evicted,
                   "elastic_ep.epoch": -1 if p.epoch is None else p.epoch})
        for m in t.migrations:
            child("migration", m.start_ns, m.end_ns, {
                "elastic_ep.kind": m.kind, "elastic_ep.src_rank": -1 if m.src_rank is None else m.src_rank,
                "elastic_ep.dst_rank": -1 if m.dst_rank is None else m.dst_rank})
        root.end(end_time=end)

    def _epoch_span(self, e: EpochSpan) -> None:
        attributes = {"elastic_ep.epoch": e.epoch, "elastic_ep.reason": e.reason, "elastic_ep.members": e.members}
        attributes |= {f"elastic_ep.{k}": v for k, v in e.fields.items() if isinstance(v, int | float | str)}
        span = self.tracer.start_span("epoch_change", start_time=e.start_ns, attributes=attributes)
        span.end(end_time=e.end_ns)
