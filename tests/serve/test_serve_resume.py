"""serve's extensions for the router: `return_token_ids` (the tokens behind each choice's
text) and `resume_output_token_ids` (a choice resumed after tokens generated elsewhere goes on
exactly as the uninterrupted choice: same tokens, and its text starts where theirs ended)."""

from __future__ import annotations

import json

import httpx
import pytest


def stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_token_ids_come_with_each_chunk_and_the_prompt_with_the_first(served):
    body = {"prompt": "héllo", "max_tokens": 12, "return_token_ids": True}
    chunks = [c for e in stream(served.url, body) for c in e["choices"]]
    whole = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    prompt_ids = httpx.post(f"{served.url}/tokenize", json={"prompt": "héllo"}).json()["tokens"]
    assert [c.get("prompt_token_ids") for c in chunks] == [prompt_ids] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert len(whole["token_ids"]) == 12 and whole["prompt_token_ids"] == prompt_ids
    plain = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()
    assert "token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("body", [
    {"prompt": "seam", "max_tokens": 30},
    {"prompt": "[random] seeded", "max_tokens": 24, "temperature": 1.0, "seed": 5, "frequency_penalty": 1.0,
     "min_tokens": 20},
    {"prompt": "stop", "max_tokens": 40, "stop": ["ld! 你"]},
], ids=["greedy", "seeded-penalties", "stop-string"])
def test_a_resumed_choice_goes_on_as_the_uninterrupted_one(served, body):
    body = {**body, "return_token_ids": True}
    chunks = [c for e in stream(served.url, body) for c in e["choices"]]
    text = "".join(c["text"] for c in chunks)
    for cut in range(1, len(chunks)):
        done = [t for c in chunks[:cut] for t in c["token_ids"]]
        sent = "".join(c["text"] for c in chunks[:cut])
        rest = [c for e in stream(served.url, {**body, "resume_output_token_ids": done}) for c in e["choices"]]
        assert sent + "".join(c["text"] for c in rest) == text, cut
        assert done + [t for c in rest for t in c["token_ids"]] == [t for c in chunks for t in c["token_ids"]]
        assert rest[-1]["finish_reason"] == chunks[-1]["finish_reason"]


def test_resume_needs_one_choice_and_room_left(served):
    two = httpx.post(f"{served.url}/v1/completions",
                     json={"prompt": "x", "n": 2, "resume_output_token_ids": [70]})
    assert two.status_code == 400 and two.json()["error"]["param"] == "resume_output_token_ids"
    full = httpx.post(f"{served.url}/v1/completions",
                      json={"prompt": "x", "max_tokens": 2, "resume_output_token_ids": [70, 71]})
    assert full.status_code == 400 and "nothing is left" in full.json()["error"]["message"]
