"""Traces and bounded metrics on a real 4-rank server: with head sampling off, the requests that
lived through a kill -9 still reach a loopback OTLP/HTTP endpoint, each with its recovery pause,
beside the recovery's epoch change; /metrics names at most --metrics-top-k ranks, the dead one
among them."""

from __future__ import annotations

import os
import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.load import StreamingLoad
from elastic_ep.harness.otlp import OtlpReceiver
from elastic_ep.harness.otlp import attributes as attrs

from .conftest import Server


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver):
    s = Server(["--model", "tiny-deepseek-v3", "--ep-size", "4", "--redundant-experts", "8",
                "--restart-delay-s", "-1", "--otlp-traces-endpoint", receiver.url, "--trace-sample-ratio", "0",
                "--metrics-top-k", "2"], tmp_path_factory.mktemp("tracing") / "serve.log",
               env={"OTEL_BSP_SCHEDULE_DELAY_MILLIS": "100", "OTEL_SERVICE_NAME": "elastic-ep-test"})
    try:
        s.wait_full_group(4)
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(240)
@pytest.mark.e2e
def test_requests_that_crossed_a_kill_are_traced_with_ratio_zero(server, receiver):
    pid = server.pids()[2]
    with StreamingLoad(server.url, threads=3, max_tokens=32, prompts=["hello world", "the cat"]) as load:
        start = server.cluster()["step"]
        server.wait_for(lambda c: c["step"] >= start + 10, 30, "10 steps")
        os.kill(pid, signal.SIGKILL)
        server.wait_for(lambda c: c["ready"] and 2 not in c["members"] and c["step"] >= start + 60, 60,
                        "recovered and serving")
    assert load.failures == []
    server.wait_for(lambda c: any(s.name == "epoch_change" and attrs(s)["elastic_ep.reason"] == "recovery"
                                  for _, s in receiver.spans())
                    and any(s.name == "recovery_pause" for _, s in receiver.spans()), 10, "the spans exported")
    spans = receiver.spans()
    assert {resource["service.name"] for resource, _ in spans} == {"elastic-ep-test"}
    roots = {s.span_id: s for _, s in spans if s.name == "llm_request"}
    assert roots and {attrs(s)["elastic_ep.sampled_by"] for s in roots.values()} <= {"fault", "p99"}
    pauses = [s for _, s in spans if s.name == "recovery_pause"]
    assert all(2 in attrs(p)["elastic_ep.culprits"] for p in pauses)
    crossed = [roots[p.parent_span_id] for p in pauses]
    assert all(attrs(r)["elastic_ep.sampled_by"] == "fault" for r in crossed)
    children = {s.name for _, s in spans if s.parent_span_id in {r.span_id for r in crossed}}
    assert {"queue", "prefill", "decode", "recovery_pause"} <= children
    # the requests that lived on rank 2 moved: a migration span from it
    assert any(attrs(s)["elastic_ep.src_rank"] == 2 for _, s in spans if s.name == "migration")


@pytest.mark.timeout(60)
@pytest.mark.e2e
def test_metrics_name_at_most_top_k_ranks_the_dead_one_first(server):
    text = server.http.get("/metrics").text
    exported = {}
    ranks = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "rank" in s.labels:
                ranks.add(s.labels["rank"])
            if s.name == "elastic_ep_rank_exported":
                exported[s.labels["rank"]] = s.labels["reason"]
    assert len(ranks) <= 2 and exported.get("2") == "down", exported
    assert "_created" not in text
