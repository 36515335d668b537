"""One bad request harms only itself, on a real 4-rank server with innocent greedy streams
running beside it: a NaN temperature is refused with a 400; a request whose steps raise (in its
rank's local computation, in its experts, in its sampling) ends alone with an error that says
why, in the same epoch; a rank that fails every step with nothing to blame is fenced as before;
fuzzed request bodies never disturb the innocent streams."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_ep.harness.fuzz import FuzzTarget
from elastic_ep.harness.load import client_for
from elastic_ep.harness.load import streams_with_fault as harness_streams_with_fault
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.tiny import resolve_model

from .conftest import PROMPTS, reference, reference_load

MODEL = "tiny-deepseek-v3"
MAX_TOKENS = 32
# --max-model-len bounds what a fuzzed body without max_tokens may generate
SERVE_ARGS = ("--model", MODEL, "--ep-size", "4", "--redundant-experts", "16", "--enable-chaos",
              "--restart-delay-s", "1.0", "--max-model-len", "64")


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(*SERVE_ARGS)


def innocent_streams_with(server, inject) -> list[str]:
    """Six greedy streams; `inject()` once each has its first chunk. Returns their texts."""
    results = harness_streams_with_fault(server.url, inject, PROMPTS, MAX_TOKENS, temperature=0)
    return [r.text for r in results]


def faults_since(cluster: dict, event_id: int) -> list[dict]:
    return [e for e in cluster["events"] if e["kind"] == "fault" and e["id"] > event_id]


def test_a_nan_temperature_gets_a_400_and_no_one_else_notices(server):
    before = server.wait_full_group(4)
    answers = {}

    def poison():
        body = b'{"model": "%s", "prompt": "hi", "max_tokens": 4, "temperature": NaN}' % MODEL.encode()
        answers["nan"] = server.http.post("/v1/completions", content=body, headers={"content-type": "application/json"})

    texts = innocent_streams_with(server, poison)
    assert texts == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    assert answers["nan"].status_code == 400 and answers["nan"].json()["error"]["param"] == "temperature"
    after = server.cluster()
    assert after["epoch"] == before["epoch"] and not faults_since(after, before["events"][-1]["id"])


@pytest.mark.parametrize("phase", ["local", "experts", "sampling", "prefill"])
def test_a_request_that_breaks_its_steps_ends_alone_in_the_same_epoch(server, phase):
    """The request is poisoned once it streams (its decode steps fail), or, for prefill, by its
    id before it arrives (its first, prefill step fails)."""
    before = server.wait_full_group(4)
    client, model = client_for(server.url)
    outcome = {}

    def poison(request_id: str) -> None:
        body = {"request_id": request_id, "phase": "local" if phase == "prefill" else phase}
        server.http.post("/chaos/poison", json=body).raise_for_status()

    def poisoned_request():
        if phase == "prefill":
            poison(f"cmpl-poisoned-{phase}")
        try:
            stream = client.completions.create(
                model=model, prompt="poisoned request", max_tokens=50, stream=True, temperature=0,
                extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": f"poisoned-{phase}"})
            for i, chunk in enumerate(stream):
                if i == 0 and phase != "prefill":
                    poison(chunk.id)
            outcome["error"] = None
        except openai.APIError as e:
            outcome["error"] = str(e)

    texts = innocent_streams_with(server, poisoned_request)
    assert texts == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    where = {"local": "local computation", "prefill": "local computation", "experts": "expert computation",
             "sampling": "sampling failed"}[phase]
    assert outcome["error"] and where in outcome["error"], outcome
    after = server.cluster()
    assert after["epoch"] == before["epoch"] and not faults_since(after, before["events"][-1]["id"])
    if phase != "sampling":  # a sampling error names its row at once; the others are found by isolation
        isolated = [e for e in after["events"] if e["kind"] == "request-error" and e["id"] > before["events"][-1]["id"]]
        assert len(isolated) == 1 and "isolated the request" in isolated[0]["message"]


def test_a_rank_that_fails_every_step_is_fenced_and_its_requests_finish_elsewhere(server):
    before = server.wait_full_group(4)
    last = before["events"][-1]["id"]
    texts = innocent_streams_with(
        server, lambda: server.http.post("/chaos/poison", json={"rank_id": 2, "phase": "local"}).raise_for_status())
    assert texts == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    cluster = server.wait_for(lambda c: any(e["kind"] == "recovered" and e["id"] > last for e in c["events"]),
                              what="a recovery")
    faults = faults_since(cluster, last)
    assert [f["rank_id"] for f in faults] == [2] and "no request to blame" in faults[0]["message"]
    assert not [e for e in cluster["events"] if e["kind"] == "request-error" and e["id"] > last]


OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@pytest.fixture(scope="module")
def fuzz_target(server):
    vocab_size = MoEConfig.from_pretrained(resolve_model(MODEL)).vocab_size
    target = FuzzTarget(server.http.get("/openapi.json").json(), MODEL, vocab_size,
                        caps={"n": 2, "max_tokens": 3, "max_completion_tokens": 3, "min_tokens": 3, "logprobs": 3,
                              "top_logprobs": 3, "prompt": 2, "messages": 2, "stop": 2, "stop_token_ids": 2,
                              "tokens": 8, "content": 2})
    target.operations = [op for op in target.operations if op.path in OPENAI_ROUTES]
    return target


def test_fuzzed_bodies_beside_innocent_streams_get_2xx_or_4xx_and_change_nothing(server, fuzz_target):
    before = server.wait_full_group(4)
    http = httpx.Client(base_url=server.url, timeout=120)

    def send(request) -> list[str]:
        response = http.request(request.operation.method, request.path, content=request.body,
                                headers={"content-type": "application/json"} if request.body else {})
        status = [] if 200 <= response.status_code < 500 else [f"{request.path} {request.body[:200]!r}: "
                                                                f"{response.status_code}"]
        return status + fuzz_target.problems(request, response)

    problems: list[str] = []

    # 150 bodies drawn at once and sent 16 at a time: the engine batches them like any traffic
    @settings(max_examples=1, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(requests=st.lists(fuzz_target.requests(), min_size=150, max_size=150))
    def fuzz(requests):
        with ThreadPoolExecutor(16) as pool:
            problems.extend(p for found in pool.map(send, requests) for p in found)

    with reference_load(server, MODEL, threads=3) as load:
        fuzz()
    http.close()
    assert not problems, problems[:5]
    assert not load.failures and load.done > 0, load.failures[:3]
    after = server.cluster()
    assert after["epoch"] == before["epoch"] and not faults_since(after, before["events"][-1]["id"])
