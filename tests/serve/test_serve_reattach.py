"""`resume_request_id` over HTTP, on a controller-group leader's app (the journaling engine over the
scripted one, a real uvicorn): a journaled request the leader runs on by itself finishes with nobody
attached, is readable by GET /journal, and a client that re-attaches gets only the tokens it lacks,
under the request's own id, with nothing generated again; a disagreeing resume is a 409, a malformed
one a 400; an id nobody holds runs anew under that id."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from scripted_engine import ScriptedEngine, ServerThread, byte_tokenizer

from elastic_ep.commands.serve_group import add_journal_route
from elastic_ep.group.adopted import AdoptedRequests
from elastic_ep.group.journal import Journaled, JournaledEngine, JournalWriter
from elastic_ep.group.store import GroupStore
from elastic_ep.serve.app import create_app
from elastic_ep.serve.group_gate import GroupGate

PROMPT = "[slow] go on"


def stream(url: str, body: dict) -> tuple[str, list[int], str]:
    """The response id, the token ids and the text of a streamed completion."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "return_token_ids": True},
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    return chunks[0]["id"], [t for c in choices for t in c["token_ids"]], "".join(c["text"] for c in choices)


def resumed(adopted: AdoptedRequests, by: str) -> float:
    return adopted.resumed.labels(by=by)._value.get()


@pytest.fixture
def leader():
    tokenizer, registry = byte_tokenizer(), CollectorRegistry()
    scripted = ScriptedEngine(tokenizer)
    # a writer that is never flushed: what it journals is tests/group's concern
    engine = JournaledEngine(scripted, JournalWriter(GroupStore("http://127.0.0.1:9", "g"), 1),
                             AdoptedRequests(registry))
    app = create_app(engine, tokenizer, registry=registry)
    add_journal_route(app, engine)
    gate = GroupGate(lambda: {}, lambda: "", registry)
    gate.lead(app)
    server = ServerThread(gate)
    try:
        yield server.url, scripted, engine, gate
    finally:
        server.stop()


def test_a_client_reattaches_to_the_request_the_leader_ran_on_and_gets_only_what_it_lacks(leader):
    url, scripted, engine, gate = leader
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    first_id, tokens, text = stream(url, body)  # the fault-free run
    original = scripted.request_of(first_id)
    # a takeover: the journal held this request with 4 tokens; the new leader runs it on at once
    held = Journaled("cmpl-old-0", original.prompt_token_ids, original.params, original.seed, tokens[:4])
    engine.adopted.start_threadsafe([held.resumed()], engine.generate, engine.forget, gate.loop())
    deadline = time.monotonic() + 20
    while not (journal := httpx.get(f"{url}/journal/cmpl-old").json())["finished"]:
        assert time.monotonic() < deadline, journal
        time.sleep(0.02)
    # it ran to its end with nobody attached: the fault-free tokens, kept for the orphan window
    assert journal["output_token_ids"] == tokens and journal["resumed_by_leader"]
    assert journal["finish_reason"] == "length" and journal["seed"] == original.seed

    # the client had received 6 tokens (two past the journal's); it re-attaches by the request's id
    rid, rest, rest_text = stream(url, {**body, "seed": original.seed, "resume_request_id": "cmpl-old-0",
                                        "resume_output_token_ids": tokens[:6]})
    assert rid == "cmpl-old" and rest == tokens[6:]
    assert tokenizer_text(url, tokens[:6]) + rest_text == text
    assert (resumed(engine.adopted, "leader"), resumed(engine.adopted, "attach"),
            resumed(engine.adopted, "client")) == (1, 1, 0)  # nothing ran again for the client
    metrics = httpx.get(f"{url}/metrics").text
    assert 'elastic_ep_requests_resumed_total{by="leader"} 1.0' in metrics

    wrong = httpx.post(f"{url}/v1/completions", json={**body, "seed": original.seed, "resume_request_id": "cmpl-old-0",
                                                      "resume_output_token_ids": [tokens[0], tokens[0] + 1]})
    assert wrong.status_code == 409, wrong.text
    assert wrong.json()["error"]["code"] == "resume_conflict"
    assert wrong.json()["error"]["param"] == "resume_output_token_ids"
    unseeded = httpx.post(f"{url}/v1/completions", json={**body, "resume_request_id": "cmpl-old-0"})
    assert unseeded.status_code == 409 and "another seed" in unseeded.json()["error"]["message"]


def test_a_reattach_to_a_request_nobody_holds_runs_anew_under_its_id(leader):
    url, scripted, engine, _ = leader
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "seed": 3}
    _, tokens, _ = stream(url, body)
    rid, rest, _ = stream(url, {**body, "resume_request_id": "cmpl-gone-0", "resume_output_token_ids": tokens[:3]})
    assert rid == "cmpl-gone" and rest == tokens[3:]
    assert scripted.request_of("cmpl-gone").reattach
    assert resumed(engine.adopted, "client") == 1


@pytest.mark.parametrize("change", [{"n": 2}, {"prompt": ["a", "b"]}, {"resume_request_id": "has space"},
                                    {"resume_request_id": ""}])
def test_a_malformed_reattach_is_a_400_naming_its_field(leader, change):
    url = leader[0]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "resume_request_id": "cmpl-a-0",
                                                  **change})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "resume_request_id"


def tokenizer_text(url: str, ids: list[int]) -> str:
    return httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]
