"""A request whose output cannot be turned into text (here the engine sends a token id no
tokenizer can decode) ends alone, with an error that says so; its engine request is aborted,
and the streams running beside it, and the server, go on untouched."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
from scripted_engine import MODEL, REPLY
from test_serve_disconnect import running_requests, wait_for


def test_a_detokenization_failure_ends_only_its_own_request(served):
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)
    http = httpx.AsyncClient(base_url=served.url, timeout=10)

    async def innocent(max_tokens: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt="[slow]", max_tokens=max_tokens, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def poisoned_stream() -> list[str]:
        body = {"prompt": "[slow][badtoken]", "max_tokens": 40, "stream": True, "n": 2}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            return [line async for line in response.aiter_lines() if line]

    async def poisoned() -> httpx.Response:
        return await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "[badtoken]"}]}
        )

    async def run():
        return await asyncio.gather(innocent(12), poisoned_stream(), innocent(16), poisoned(), innocent(20))

    first, stream_lines, second, answer, third = asyncio.run(run())
    assert [first, second, third] == [REPLY.encode()[:n].decode(errors="replace") for n in (12, 16, 20)]
    assert answer.status_code == 500
    assert answer.json()["error"]["code"] == "detokenization_error"
    assert "the server goes on" in answer.json()["error"]["message"]
    assert stream_lines[-1] == "data: [DONE]"
    error = json.loads(stream_lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "detokenization_error"
    decode = served.engine.tokenizer.decode
    poisoned_ids = [
        rid for rid, r in served.engine.requests.items() if "[badtoken]" in decode(r.prompt_token_ids)
    ]
    assert len(poisoned_ids) == 3
    assert wait_for(lambda: all(rid in served.engine.aborted for rid in poisoned_ids))
    assert wait_for(lambda: running_requests(served) == 0)
    assert (
        httpx.post(f"{served.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    )
