"""Schema-driven fuzzing of every documented route against a real server: each request gets
a status and content type that /openapi.json documents for its route, never a 5xx, and the
server serves normally afterwards. Deterministic (derandomized) and bounded in examples."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scripted_engine import MODEL

from elastic_ep.harness.fuzz import FuzzTarget


@pytest.fixture(scope="module")
def target(served):
    return FuzzTarget(
        httpx.get(f"{served.url}/openapi.json").json(), MODEL, served.engine.info.extra["vocab_size"]
    )


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield client


@settings(
    max_examples=800,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_fuzzed_requests_get_documented_answers(served, target, http, data):
    request = data.draw(target.requests())
    response = http.request(
        request.operation.method,
        request.path,
        content=request.body,
        headers={"content-type": "application/json"} if request.body else {},
    )
    # pytest --hypothesis-show-statistics shows how often each route answered each status.
    event(f"{request.operation.method} {request.operation.path} {response.status_code}")
    assert target.problems(request, response) == []


def test_the_server_serves_normally_after_the_fuzzing(served, http):
    assert http.get("/health").status_code == 200
    reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["finish_reason"] == "length"
