"""The OpenAI routes driven by the real `openai` client against a real uvicorn server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from scripted_engine import MAX_MODEL_LEN, MODEL, REPLY


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_returns_text_usage_and_length_finish(client, served):
    response = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=13)
    assert response.object == "text_completion"
    assert response.model == MODEL
    assert response.choices[0].text == REPLY.encode()[:13].decode()
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(b"Say hi")
    assert response.usage.completion_tokens == 13
    assert response.usage.total_tokens == 19
    assert (
        served.engine.request_of(response.id).prompt_token_ids == served.engine.tokenizer.encode("Say hi").ids
    )


def test_streamed_completion_concatenates_to_the_whole_text_and_never_splits_a_character(client):
    # 30 tokens end inside "好" (3 bytes); two tokens per event split "ö" and "你" across events.
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=30, stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == REPLY.encode()[:30].decode(errors="replace")
    assert all("\ufffd" not in t for t in texts[:-1])
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stop_string_cuts_the_text_and_finishes_with_stop(client):
    response = client.completions.create(model=MODEL, prompt="hi", max_tokens=40, stop=["END", "zzz"])
    assert response.choices[0].text == REPLY[: REPLY.index("END")]
    assert response.choices[0].finish_reason == "stop"


def test_streamed_stop_string_never_reaches_the_client(client):
    chunks = list(
        client.completions.create(model=MODEL, prompt="hi", max_tokens=40, stop="END of", stream=True)
    )
    text = "".join(c.choices[0].text for c in chunks)
    assert text == REPLY[: REPLY.index("END of")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_eos_finishes_with_stop_and_is_not_in_the_text(client):
    response = client.completions.create(model=MODEL, prompt="[eos]", max_tokens=20)
    assert response.choices[0].text == REPLY[:4]
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == 5


def test_prompt_as_token_ids(client, served):
    ids = served.engine.tokenizer.encode("abc").ids
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
    assert served.engine.request_of(response.id).prompt_token_ids == ids
    response = client.completions.create(model=MODEL, prompt=[ids], max_tokens=2)
    assert served.engine.request_of(response.id).prompt_token_ids == ids


def test_sampling_parameters_and_seed_reach_the_engine(client, served):
    response = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, temperature=0.7, top_p=0.9, seed=1234, extra_body={"top_k": 5}
    )
    request = served.engine.request_of(response.id)
    assert request.seed == 1234
    assert (request.params.temperature, request.params.top_p, request.params.top_k) == (0.7, 0.9, 5)
    assert request.params.max_tokens == 3


def test_a_seed_is_drawn_at_admission_when_the_client_gives_none(client, served):
    seeds = {
        served.engine.request_of(client.completions.create(model=MODEL, prompt="hi", max_tokens=1).id).seed
        for _ in range(3)
    }
    assert len(seeds) == 3


def test_chat_completion(client, served):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_completion_tokens=5,
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == REPLY[:5]
    assert response.choices[0].finish_reason == "length"
    prompt = served.engine.tokenizer.decode(served.engine.request_of(response.id).prompt_token_ids)
    assert prompt == "system: Be brief.\nuser: Hello\nassistant:"
    assert response.usage.prompt_tokens == len(prompt.encode())


def test_streamed_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        max_tokens=20,
        stop=["!"],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == REPLY[: REPLY.index("!")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens >= len(content.encode())
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format_ends_with_done(served):
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_engine_error_event_is_a_500_and_an_error_event_in_a_stream(served):
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": "[error]", "max_tokens": 10})
    assert response.status_code == 500
    assert "rank 2 lost its KV cache" in response.json()["error"]["message"]
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json={"prompt": "[error]", "max_tokens": 10, "stream": True}
    ) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert "rank 2 lost its KV cache" in lines[-2]
    assert lines[-1] == "data: [DONE]"


def test_integer_temperature_is_accepted(served):
    response = httpx.post(
        f"{served.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0}
    )
    assert response.status_code == 200
    assert served.engine.request_of(response.json()["id"]).params.temperature == 0.0


def test_concurrent_streams_each_get_their_own_text(served):
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)

    async def one(max_tokens: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt="[slow]", max_tokens=max_tokens, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def many() -> list[str]:
        return await asyncio.gather(*(one(n) for n in range(3, 19, 2)))

    assert asyncio.run(many()) == [REPLY.encode()[:n].decode(errors="replace") for n in range(3, 19, 2)]
