"""Every numeric field is checked as vLLM checks it: NaN, ±Infinity (which Python's JSON
parser accepts), 1e308, out of range, huge or negative ints and wrong types are a 400 that
names the field, never a 500 and never a request the engine sees. Fields the server does not
implement are refused by name."""

from __future__ import annotations

import json

import httpx
import pytest

NOT_A_NUMBER = ["NaN", "Infinity", "-Infinity", "1e400", '"0.5"', "true", "[0.5]", "{}"]
HUGE_INT = str(10**30)
# field -> JSON values that must be refused, besides NOT_A_NUMBER
NUMERIC_FIELDS = {
    "temperature": ["1e308", "-1e308", "-0.01", "2.01"],
    "top_p": ["0", "-0.5", "1.01", "1e308"],
    "min_p": ["-0.01", "1.01", "1e308"],
    "presence_penalty": ["-2.01", "2.01", "1e308"],
    "frequency_penalty": ["-2.01", "2.01", "-1e308"],
    "repetition_penalty": ["0", "-1", "2.01", "1e308"],
    "top_k": ["-2", "1.5", HUGE_INT],
    "seed": [str(2**63), str(-(2**63) - 1), "1.5", HUGE_INT],
    "max_tokens": ["0", "-3", "1.5", "1e308", HUGE_INT],
    "n": ["0", "-1", "129", "1.5", HUGE_INT],
    "min_tokens": ["-1", "17", "1.5", HUGE_INT],
    "logprobs": ["-1", "21", "1.5", HUGE_INT],
}
CHAT_FIELDS = {
    "max_completion_tokens": ["0", "-1", "1.5", HUGE_INT],
    "top_logprobs": ["-1", "21", "1.5", HUGE_INT],
}
LIST_FIELDS = {
    "stop_token_ids": ["[-1]", f"[{HUGE_INT}]", "[1.5]", "[NaN]", "[1000]"],
    "logit_bias": ['{"1": NaN}', '{"1": Infinity}', '{"1": 101}', '{"x": 1}', '{"99999": 1}', '{"1": "1"}'],
}


def cases(fields: dict[str, list[str]], with_not_a_number: bool) -> list[tuple[str, str]]:
    return [
        (f, v) for f, values in fields.items() for v in values + (NOT_A_NUMBER if with_not_a_number else [])
    ]


def post(served, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", content=raw, headers={"content-type": "application/json"})


def assert_refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field or error["param"].startswith(f"{field}."), error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("field", "value"), cases(NUMERIC_FIELDS, True) + cases(LIST_FIELDS, False))
def test_bad_numbers_are_refused_naming_the_field(served, field, value):
    seen = set(served.engine.requests)
    body = f'{{"prompt": "hi", "temperature": 0.5, "{field}": {value}}}'.replace(
        '"temperature": 0.5, "temperature"', '"temperature"'
    )
    assert_refused(post(served, "/v1/completions", body.encode()), field)
    assert set(served.engine.requests) == seen


@pytest.mark.parametrize(("field", "value"), cases(CHAT_FIELDS, True))
def test_bad_numbers_in_chat_are_refused_naming_the_field(served, field, value):
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "logprobs": true, "{field}": {value}}}'
    assert_refused(post(served, "/v1/chat/completions", body.encode()), field)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/scale_elastic_ep", "new_ep_size", "NaN"),
        ("/scale_elastic_ep", "new_ep_size", "1.5"),
        ("/scale_elastic_ep", "new_ep_size", "-1"),
        ("/detokenize", "tokens", "[NaN]"),
        ("/detokenize", "tokens", f"[{HUGE_INT}]"),
    ],
)
def test_bad_numbers_on_other_routes_are_refused_naming_the_field(served, path, field, value):
    assert_refused(post(served, path, f'{{"{field}": {value}}}'.encode()), field)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "tools", '[{"type": "function", "function": {"name": "f"}}]'),
        ("/v1/chat/completions", "tool_choice", '"auto"'),
        ("/v1/chat/completions", "response_format", '{"type": "json_object"}'),
        ("/v1/chat/completions", "functions", "[]"),
        ("/v1/chat/completions", "parallel_tool_calls", "true"),
        ("/v1/completions", "suffix", '"end"'),
        ("/v1/completions", "best_of", "2"),
        ("/v1/completions", "guided_json", "{}"),
    ],
)
def test_unsupported_fields_are_refused_by_name(served, path, field, value):
    base = '"messages": [{"role": "user", "content": "hi"}]' if "chat" in path else '"prompt": "hi"'
    response = post(served, path, f'{{{base}, "{field}": {value}}}'.encode())
    assert_refused(response, field)
    assert "not supported" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ('{"prompt": "hi", "stream_options": {"include_usage": true}}', "stream_options", "stream: true"),
        ('{"prompt": "hi", "echo": true, "logprobs": 1}', "echo", "prompt's logprobs"),
        ('{"prompt": "hi", "max_tokens": 4, "min_tokens": 5}', "min_tokens", "max_tokens=4"),
        ('{"prompt": ["a", "b", "c"], "n": 50}', "n", "150 choices"),
        ('{"prompt": "a\\ud800b"}', "prompt", "Unicode"),
        ('{"prompt": ["ok", ""]}', "prompt", "empty"),
        ('{"prompt": [[1, 2], []]}', "prompt", "empty"),
        ('{"prompt": "hi", "stop": ["x", ""]}', "stop", "at least 1 character"),
        (json.dumps({"prompt": "hi", "stop": "x" * 1025}), "stop", "at most 1024 characters"),
        (json.dumps({"prompt": "hi", "stop": ["x"] * 65}), "stop", "at most 64 items"),
    ],
)
def test_fields_that_contradict_each_other_are_refused(served, body, field, needle):
    response = post(served, "/v1/completions", body.encode())
    assert_refused(response, field)
    assert needle in response.json()["error"]["message"]


def test_top_logprobs_needs_logprobs(served):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}'
    assert_refused(post(served, "/v1/chat/completions", body), "top_logprobs")
