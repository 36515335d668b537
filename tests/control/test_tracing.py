"""Request traces: decided at the end of each request (head ratio, or forced by a fault, an
eviction or the p99 latency), exported as OpenTelemetry spans; nothing of the SDK imported when off."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from elastic_ep.control.otel import OtelSink, traces_url
from elastic_ep.control.tracing import P99_MIN_SAMPLES, RequestTraces
from elastic_ep.errors import ElasticEPError


def traces(ratio: float) -> tuple[RequestTraces, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return RequestTraces(OtelSink(exporter, model_name="tiny", batch=False), ratio, random.Random(0)), exporter


def serve(t: RequestTraces, seq_id: int, rank: int = 0, slowest: int = 0) -> None:
    t.arrived(seq_id, f"req-{seq_id}", 2)
    for n in (1, 2):
        now = time.time_ns()
        t.step({rank: [seq_id]}, now, now + 1000, slowest, [(seq_id, n)], [])
    t.finished(seq_id, "length")


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    out: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.name, []).append(span)
    return out


def test_a_request_that_crossed_a_fault_is_traced_whatever_the_ratio():
    t, exporter = traces(0.0)
    serve(t, 1)  # not sampled: nothing exported
    assert exporter.get_finished_spans() == ()
    t.arrived(2, "req-2", 2)
    now = time.time_ns()
    t.step({1: [2]}, now, now + 1000, 1, [(2, 1)], [])
    t.recovery_began(time.monotonic(), "rank 1: process exited", [1], evicted=False)
    t.moved(2, "fault", 1, None, time.time_ns())
    t.recovery_ended(epoch=4)
    t.step({3: [2]}, time.time_ns(), time.time_ns(), 3, [(2, 2)], [])
    t.finished(2, "stop")
    spans = spans_by_name(exporter)
    (root,) = spans["llm_request"]
    assert root.attributes["gen_ai.request.id"] == "req-2"
    assert root.attributes["elastic_ep.sampled_by"] == "fault"
    assert list(root.attributes["elastic_ep.ranks"]) == [1, 3]
    (pause,) = spans["recovery_pause"]
    assert pause.parent.span_id == root.context.span_id
    assert list(pause.attributes["elastic_ep.culprits"]) == [1] and pause.attributes["elastic_ep.epoch"] == 4
    (move,) = spans["migration"]
    assert move.attributes["elastic_ep.kind"] == "fault" and move.attributes["elastic_ep.src_rank"] == 1
    assert {"queue", "prefill", "decode"} <= set(spans)
    assert all(s.parent.span_id == root.context.span_id for n in ("queue", "prefill", "decode") for s in spans[n])
    assert t.emitted == {"dropped": 1, "fault": 1}


def test_an_eviction_is_named_and_a_request_after_the_recovery_is_not_forced():
    t, exporter = traces(0.0)
    t.arrived(1, "req-1", 2)
    t.recovery_began(time.monotonic(), "rank 5 evicted", [5], evicted=True)
    t.recovery_ended(epoch=2)
    t.finished(1, "stop")
    serve(t, 2)
    (root,) = spans_by_name(exporter)["llm_request"]
    assert root.attributes["elastic_ep.sampled_by"] == "eviction"


def test_head_sampling_follows_the_ratio():
    t, exporter = traces(0.25)
    for seq_id in range(400):
        serve(t, seq_id)
    head = t.emitted["head"]
    assert 60 <= head <= 140, head
    assert t.emitted["dropped"] + head + t.emitted["p99"] == 400


def test_the_slowest_requests_are_forced_by_the_p99():
    t, exporter = traces(0.0)
    for seq_id in range(P99_MIN_SAMPLES):
        serve(t, seq_id)
    t.arrived(999, "slow", 2)
    time.sleep(0.05)
    t.finished(999, "stop")
    roots = spans_by_name(exporter)["llm_request"]
    assert [r.attributes["gen_ai.request.id"] for r in roots
            if r.attributes["elastic_ep.sampled_by"] == "p99"][-1] == "slow"


def test_decode_names_the_rank_its_steps_waited_for():
    t, exporter = traces(1.0)
    serve(t, 1, rank=0, slowest=6)
    (decode,) = spans_by_name(exporter)["decode"]
    assert decode.attributes["elastic_ep.waited_on_rank"] == 6
    assert decode.attributes["elastic_ep.waited_on_share"] == 1.0


def test_an_epoch_change_is_a_span():
    t, exporter = traces(0.0)
    t.epoch_changed(3, "recovery", [0, 2, 3], time.monotonic() - 0.2, {"transfer_s": 0.1, "transfers": {}})
    (span,) = spans_by_name(exporter)["epoch_change"]
    assert span.attributes["elastic_ep.reason"] == "recovery" and span.attributes["elastic_ep.transfer_s"] == 0.1
    assert 0.15 < (span.end_time - span.start_time) / 1e9 < 1.0


def test_bad_ratio_is_refused():
    with pytest.raises(ElasticEPError, match="trace-sample-ratio"):
        RequestTraces(OtelSink(InMemorySpanExporter(), batch=False), 1.5)


def test_endpoint_without_a_path_gets_the_traces_path():
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("http://c:4318/custom") == "http://c:4318/custom"


def test_no_opentelemetry_sdk_is_imported_without_an_endpoint():
    code = ("import sys; import elastic_ep.control.controller, elastic_ep.serve.app, elastic_ep.commands.serve; "
            "print([m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
