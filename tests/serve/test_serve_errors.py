"""Every bad input gets a 4xx with the OpenAI error body, the engine's refusals keep their
meaning (503 + Retry-After), an unexpected failure is a 500, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest
from scripted_engine import MAX_MODEL_LEN, MODEL

LONG_PROMPT = "x" * MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "needle"),
    [
        ("/v1/completions", b"{not json", 400, None, "malformed JSON"),
        ("/v1/completions", b"", 400, None, "body is empty"),
        ("/v1/completions", b"[1, 2]", 400, None, "object"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt", "prompt"),
        ("/v1/completions", b'{"prompt": 5}', 400, "prompt", "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens", "integer"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature", "number"),
        ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream", "boolean"),
        ("/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', 404, "model", MODEL),
        ("/v1/completions", b'{"prompt": ""}', 400, "prompt", "empty"),
        ("/v1/completions", b'{"prompt": []}', 400, "prompt", "empty"),
        ("/v1/completions", b'{"prompt": [1, 99999]}', 400, "prompt", "vocabulary"),
        (
            "/v1/completions",
            f'{{"prompt": "{LONG_PROMPT}"}}'.encode(),
            400,
            "prompt",
            f"{MAX_MODEL_LEN} tokens",
        ),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 127}', 400, "max_tokens", "at most 126"),
        (
            "/v1/completions",
            b'{"prompt": "hi", "max_tokens": 0}',
            400,
            "max_tokens",
            "greater than or equal to 1",
        ),
        (
            "/v1/completions",
            b'{"prompt": "hi", "max_tokens": -3}',
            400,
            "max_tokens",
            "greater than or equal to 1",
        ),
        (
            "/v1/completions",
            b'{"prompt": "hi", "temperature": -1}',
            400,
            "temperature",
            "greater than or equal to 0",
        ),
        ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "top_p", "greater than 0"),
        ("/v1/completions", b'{"prompt": "hi", "stop": [""]}', 400, "stop.0", "at least 1 character"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages", "empty"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "wizard", "content": "x"}]}',
            400,
            "messages.0.role",
            "wizard",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
            400,
            "max_completion_tokens",
            "greater than or equal to 1",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            400,
            "messages",
            "only text",
        ),
        ("/v1/nothing", b"{}", 404, None, "Not Found"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
    served, path, body, status, param, needle
):
    response = httpx.post(f"{served.url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"]
    assert error["param"] == param
    assert (
        httpx.post(f"{served.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    )


def test_unknown_model_is_model_not_found_for_the_openai_client(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.code == "model_not_found"
    assert MODEL in raised.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_service_unavailable_is_a_503_with_retry_after(served, stream):
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": "[busy]", "stream": stream})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "7"
    assert "no live replica" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_crash_is_a_500_and_the_server_keeps_serving(served, stream):
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": "[crash]", "stream": stream})
    assert response.status_code == 500
    assert "scripted engine crash" in response.json()["error"]["message"]
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert (
        httpx.post(f"{served.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    )
