"""Streams through the router over in-process serve instances (the scripted engine): the same
answer as one instance gives, and the same answer again when the instance fails mid-stream and
the stream is carried on by another (tokens, text across the seam, ids, indices, usage)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from elastic_ep.control.api import Readiness
from elastic_ep.router.config import RouterConfig


def sse(url: str, path: str, body: dict, headers: dict | None = None) -> list[dict]:
    """Every event of a streamed answer, [DONE] excluded (asserted last)."""
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        events.append(json.loads(line[len("data: "):]))
    return events


def by_choice(events: list[dict], chat: bool) -> dict[int, dict]:
    """index -> {text, token_ids, finish_reason, logprobs, offsets, roles} over a stream."""
    out: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            o = out.setdefault(c["index"], {"text": "", "token_ids": [], "finish": None, "logprobs": [],
                                            "offsets": [], "roles": 0})
            if chat:
                o["text"] += c["delta"].get("content") or ""
                o["roles"] += "role" in c["delta"]
                o["logprobs"] += [(t["token"], t["logprob"]) for t in (c["logprobs"] or {}).get("content") or []]
            else:
                o["text"] += c["text"]
                lp = c["logprobs"]
                if lp:
                    o["logprobs"] += list(zip(lp["tokens"], lp["token_logprobs"], strict=True))
                    o["offsets"] += lp["text_offset"]
            o["token_ids"] += c.get("token_ids") or []
            o["finish"] = c["finish_reason"] or o["finish"]
    return out


def usage(events: list[dict]) -> dict:
    return [e for e in events if e.get("usage")][-1]["usage"]


def first_backend(router, route: str, body: dict):
    key, user = router.core.key_of(route, body)
    return router.core.admission.pick(key, user)


COMPLETION = ("completion", "/v1/completions")
CHAT = ("chat", "/v1/chat/completions")


@pytest.mark.parametrize("fail_after", [1, 2, 3, 6])
@pytest.mark.parametrize("case", [
    pytest.param((COMPLETION, {"prompt": "a seam", "max_tokens": 30, "logprobs": 2}), id="greedy-logprobs"),
    pytest.param((COMPLETION, {"prompt": ["[random] one", "[random] two"], "n": 2, "max_tokens": 20,
                               "temperature": 1.0, "seed": 11, "presence_penalty": 1.5,
                               "frequency_penalty": 0.5, "min_tokens": 12}), id="seeded-n2-prompts2-penalties"),
    pytest.param((COMPLETION, {"prompt": "stop across", "max_tokens": 40, "stop": ["ld! 你"], "echo": True}),
                 id="stop-string-echo"),
    pytest.param((CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "logprobs": True,
                         "top_logprobs": 1, "n": 2}), id="chat-n2-logprobs"),
])
def test_a_stream_whose_instance_fails_goes_on_elsewhere_unchanged(instances, routers, case, fail_after):
    (route, path), body = case
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url, b.url), poll_interval_s=0.1))
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    reference = sse(b.url, path, body)
    failing = first_backend(router, route, body).url
    (a if failing == a.url else b).engine.fail_after_events = fail_after
    other = b if failing == a.url else a
    events = sse(router.url, path, body)
    chat = route == "chat"
    got, want = by_choice(events, chat), by_choice(reference, chat)
    assert got.keys() == want.keys()
    for index, w in want.items():
        g = got[index]
        assert (g["text"], g["token_ids"], g["finish"], g["logprobs"], g["offsets"]) == (
            w["text"], w["token_ids"], w["finish"], w["logprobs"], w["offsets"]), index
        assert g["roles"] == w["roles"]
    assert usage(events) == usage(reference)
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    resumed = [r for r in other.engine.requests.values() if r.resumed_output_token_ids]
    assert resumed, "no choice was resumed on the other instance: the failure did not land mid-stream"
    # each names the request it goes on (a new controller-group leader would attach it to its own run)
    first_ids = {r.request_id for r in (a if failing == a.url else b).engine.requests.values()}
    assert all(r.reattach and r.request_id in first_ids for r in resumed), resumed


@pytest.mark.parametrize("case", [(COMPLETION, {"prompt": "before any token", "max_tokens": 12}),
                                  (CHAT, {"messages": [{"role": "user", "content": "early"}], "max_tokens": 12})],
                         ids=["completion", "chat"])
def test_a_stream_broken_before_its_first_chunk_resumes_naming_its_request(instances, routers, case):
    """The router names the request up front (X-Request-Id), so a stream whose instance fails before
    any chunk still names the request it goes on (a controller group's new leader attaches it to the
    run it took over) and the client sees that id."""
    (route, path), body = case
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url, b.url), poll_interval_s=0.1))
    body = {**body, "stream": True, "return_token_ids": True}
    reference = by_choice(sse(b.url, path, body), route == "chat")
    failing = a if first_backend(router, route, body).url == a.url else b
    other = b if failing is a else a
    failing.engine.fail_after_events = 0
    events = sse(router.url, path, body, headers={"X-Request-Id": "early-1"})
    got = by_choice(events, route == "chat")
    assert (got[0]["text"], got[0]["token_ids"]) == (reference[0]["text"], reference[0]["token_ids"])
    [first] = [r for r in failing.engine.requests.values() if "early-1" in r.request_id]
    [resumed] = [r for r in other.engine.requests.values() if "early-1" in r.request_id]
    assert not resumed.resumed_output_token_ids and resumed.reattach
    prefix = "chatcmpl" if route == "chat" else "cmpl"
    assert resumed.request_id == first.request_id == f"{prefix}-early-1-0"
    assert {e["id"] for e in events} == {f"{prefix}-early-1"}


def test_a_resume_the_backend_will_not_attach_runs_there_as_a_copy_of_its_own(instances, routers):
    """A 409 resume_conflict to a resume that names its request: the router sends it again without the
    name (the tokens alone), and the stream is as the uninterrupted one."""
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url, b.url), poll_interval_s=0.1))
    body = {"prompt": "[held] on", "max_tokens": 20, "stream": True, "return_token_ids": True}
    reference = by_choice(sse(b.url, "/v1/completions", body), False)
    failing = first_backend(router, "completion", body).url
    (a if failing == a.url else b).engine.fail_after_events = 2
    other = b if failing == a.url else a
    got = by_choice(sse(router.url, "/v1/completions", body), False)
    assert (got[0]["text"], got[0]["token_ids"]) == (reference[0]["text"], reference[0]["token_ids"])
    resumed = [r for r in other.engine.requests.values() if r.resumed_output_token_ids]
    assert resumed and not any(r.reattach for r in resumed)


def test_token_ids_stay_inside_the_router_unless_asked_for(instances, routers):
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url, b.url), poll_interval_s=0.1))
    body = {"prompt": "plain", "max_tokens": 10, "stream": True}
    reference = "".join(c["text"] for e in sse(a.url, "/v1/completions", body) for c in e["choices"])
    failing = first_backend(router, "completion", body)
    (a if failing.url == a.url else b).engine.fail_after_events = 2
    events = sse(router.url, "/v1/completions", body)
    assert all("token_ids" not in c and "prompt_token_ids" not in c for e in events for c in e["choices"])
    assert not any("usage" in e for e in events)
    assert "".join(c["text"] for e in events for c in e["choices"]) == reference


def test_a_choice_moves_at_most_migration_limit_times(instances, routers):
    a, b = instances(2)
    a.engine.fail_after_events = b.engine.fail_after_events = 1
    router = routers(RouterConfig(backends=(a.url, b.url), poll_interval_s=0.1, migration_limit=2))
    events = sse(router.url, "/v1/completions", {"prompt": "doomed", "max_tokens": 30, "stream": True})
    assert events[-1]["error"]["code"] == "migration_limit"
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == "Hello,"  # 3 tries of 2 tokens
    assert metric(router.url, "elastic_ep_router_migrations_total") == 2


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def test_a_stream_silent_on_an_instance_that_is_no_longer_ready_moves(instances, routers):
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url, b.url), poll_interval_s=0.05, stream_check_s=0.2))
    body = {"prompt": "hang here", "max_tokens": 24, "stream": True, "return_token_ids": True}
    reference = sse(b.url, "/v1/completions", body)
    hung = a if first_backend(router, "completion", body).url == a.url else b
    hung.engine.pause_after_events = 3
    result: list = []
    reader = threading.Thread(target=lambda: result.append(sse(router.url, "/v1/completions", body)))
    started_s = time.monotonic()
    reader.start()
    while not hung.engine.requests:
        assert time.monotonic() - started_s < 10
        time.sleep(0.01)
    time.sleep(0.3)  # it has sent its 3 events and hangs, still connected
    hung.engine.ready = Readiness(False, "stalled: the step in flight has run 3.1s")
    reader.join(20)
    assert not reader.is_alive(), "the stream stayed on the hung instance"
    got = by_choice(result[0], chat=False)[0]
    want = by_choice(reference, chat=False)[0]
    assert (got["text"], got["token_ids"]) == (want["text"], want["token_ids"])
    assert time.monotonic() - started_s < 10  # it did not wait for the hung instance's 30 s
