"""A client that goes away must not leave its request running: the server closes the
engine's iterator, which is how the engine learns to abort and free the KV cache."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if condition():
            return True
        time.sleep(0.02)
    return False


def aborted_requests(served) -> float:
    text = httpx.get(f"{served.url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "elastic_ep_request_success_total" and s.labels["finished_reason"] == "abort")


def running_requests(served) -> float:
    text = httpx.get(f"{served.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["elastic_ep_http_requests_running"].samples[0].value


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_the_request(served, path):
    aborted = aborted_requests(served)
    body = {"max_tokens": 60, "stream": True}
    body |= (
        {"prompt": "[slow]"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "[slow]"}]}
    )
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{served.url}{path}", json=body) as response,
    ):
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line)[len("data: ") :])
        request_id = f"{first['id']}-0"
        assert request_id in served.engine.requests
    assert wait_for(lambda: request_id in served.engine.aborted), "the engine never saw the abort"
    assert request_id not in served.engine.finished
    assert wait_for(lambda: running_requests(served) == 0)
    assert aborted_requests(served) == aborted + 1  # counted as vLLM counts it: finished_reason abort


@pytest.mark.parametrize(
    ("prompt", "stream"),
    [("[slow] patient", False), ("[stall] first token", False), ("[stall] first token", True)],
)
def test_disconnect_before_the_answer_starts_aborts_the_request(served, prompt, stream):
    before = set(served.engine.requests)
    with pytest.raises(httpx.ReadTimeout):
        body = {"prompt": prompt, "max_tokens": 60, "stream": stream}
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=0.3)
    (request_id,) = set(served.engine.requests) - before
    assert wait_for(lambda: request_id in served.engine.aborted), "the engine never saw the abort"
    assert wait_for(lambda: running_requests(served) == 0)


def test_a_stop_string_ends_the_engine_request_too(served):
    response = httpx.post(
        f"{served.url}/v1/completions", json={"prompt": "hi", "max_tokens": 60, "stop": "!"}
    )
    request_id = f"{response.json()['id']}-0"
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert wait_for(lambda: request_id in served.engine.aborted)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_every_choice(served, path, caplog):
    body = {"max_tokens": 60, "stream": True, "n": 3}
    body |= (
        {"prompt": "[slow]"} if "chat" not in path else {"messages": [{"role": "user", "content": "[slow]"}]}
    )
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{served.url}{path}", json=body) as response,
    ):
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line)[len("data: ") :])
    request_ids = [f"{first['id']}-{i}" for i in range(3)]
    assert wait_for(lambda: all(r in served.engine.aborted for r in request_ids)), "a choice kept running"
    assert wait_for(lambda: running_requests(served) == 0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_disconnect_while_collecting_choices_aborts_every_choice(served):
    before = set(served.engine.requests)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{served.url}/v1/completions",
            json={"prompt": ["[slow] a", "[slow] b"], "n": 2, "max_tokens": 60},
            timeout=0.3,
        )
    request_ids = set(served.engine.requests) - before
    assert len(request_ids) == 4
    assert wait_for(lambda: request_ids <= served.engine.aborted), "a choice kept running"
    assert wait_for(lambda: running_requests(served) == 0)
