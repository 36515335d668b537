"""vLLM's routes and fields a vLLM user reaches for: GET /v1/models/{id} (the `openai` client's
models.retrieve), /version, /ping (GET and POST), and `stop_reason` in every choice."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from scripted_engine import MODEL, REPLY

from elastic_ep import __version__
from elastic_ep.control.api import Health


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_models_retrieve_gives_the_served_models_card(client):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "elastic-ep")


def test_an_unknown_model_id_is_a_404_with_an_openai_error(client, served):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.status_code == 404
    error = httpx.get(f"{served.url}/v1/models/org/gpt-4").json()["error"]
    assert error["code"] == "model_not_found" and "'org/gpt-4' does not exist" in error["message"]


def test_version(served):
    assert httpx.get(f"{served.url}/version").json() == {"version": __version__}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health_does(served, method):
    assert httpx.request(method, f"{served.url}/ping").json() == {"status": "ok", "reason": ""}
    served.engine.healthy = Health("dead", "the control loop stopped: boom")
    try:
        assert httpx.request(method, f"{served.url}/ping").status_code == 503
    finally:
        served.engine.healthy = Health("ok")


def test_stop_reason_names_the_stop_string(client):
    choice = client.completions.create(model=MODEL, prompt="hi", max_tokens=40, stop=["zzz", "END"]).choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", "END")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                          stop="END").choices[0]
    assert chat.model_extra["stop_reason"] == "END"


def test_stop_reason_names_the_stop_token_id(client, served):
    bang = served.engine.tokenizer.encode("!").ids
    choice = client.completions.create(model=MODEL, prompt="hi", max_tokens=40,
                                       extra_body={"stop_token_ids": bang}).choices[0]
    assert choice.model_extra["stop_reason"] == bang[-1]


def test_stop_reason_is_null_for_eos_and_length(client):
    eos = client.completions.create(model=MODEL, prompt="[eos]", max_tokens=20).choices[0]
    assert (eos.finish_reason, eos.model_extra["stop_reason"]) == ("stop", None)
    length = client.completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0]
    assert (length.finish_reason, length.model_extra["stop_reason"]) == ("length", None)


def test_streamed_choices_carry_stop_reason_on_the_last_event(served):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "stop": "END", "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    reasons = [e["choices"][0]["stop_reason"] for e in events]
    assert reasons[-1] == "END" and set(reasons[:-1]) <= {None}
    assert "".join(e["choices"][0]["text"] for e in events) == REPLY[: REPLY.index("END")]


def test_the_new_routes_are_in_the_openapi_document(served):
    paths = httpx.get(f"{served.url}/openapi.json").json()["paths"]
    assert {"/v1/models/{model_id}", "/version", "/ping"} <= set(paths)
    assert set(paths["/ping"]) == {"get", "post"}
    assert "404" in paths["/v1/models/{model_id}"]["get"]["responses"]
