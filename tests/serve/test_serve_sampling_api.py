"""The OpenAI API as vLLM serves it, driven by the real `openai` client against a real server:
n choices (streaming too), lists of prompts, logprobs, echo, stop_token_ids, min_tokens,
ignore_eos, every sampling field reaching the engine, /tokenize and /detokenize."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from scripted_engine import MAX_MODEL_LEN, MODEL, REPLY

from elastic_ep.serve.prompts import choice_seed

RANDOM = "[random] tell me anything"


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def encode(served, text):
    return served.engine.tokenizer.encode(text).ids


def test_n_seeded_choices_differ_reproduce_and_get_seeds_derived_from_the_request_seed(client, served):
    def texts(seed):
        response = client.completions.create(
            model=MODEL, prompt=RANDOM, max_tokens=12, temperature=1.0, seed=seed, n=3
        )
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert [served.engine.request_of(response.id, i).seed for i in range(3)] == [
            choice_seed(seed, i) for i in range(3)
        ]
        assert response.usage.completion_tokens == 36
        assert response.usage.prompt_tokens == len(RANDOM.encode())
        return [c.text for c in response.choices]

    first = texts(1234)
    assert len(set(first)) == 3
    assert texts(1234) == first
    assert texts(99) != first


def test_greedy_n_gives_identical_choices(client):
    response = client.completions.create(model=MODEL, prompt=RANDOM, max_tokens=8, temperature=0, n=3)
    assert len({c.text for c in response.choices}) == 1


def test_streamed_n_choices_carry_their_index_and_match_the_unstreamed_answer(client):
    body = {"model": MODEL, "prompt": RANDOM, "max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 2}
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    streamed = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in whole.choices]
    finishes = [c.choices[0] for c in chunks[:-1] if c.choices[0].finish_reason]
    assert sorted(c.index for c in finishes) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 20


def test_streamed_chat_n_choices_each_start_with_the_role(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, n=2, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    assert [c.index for c in chunks if c.delta.role == "assistant"] == [0, 1]
    for index in (0, 1):
        assert "".join(c.delta.content or "" for c in chunks if c.index == index) == REPLY[:5]


def test_prompt_lists_give_choices_prompt_major(client, served):
    prompts = ["first prompt", "second"]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for index, prompt in enumerate(["first prompt", "first prompt", "second", "second"]):
        assert served.engine.request_of(response.id, index).prompt_token_ids == encode(served, prompt)
    assert response.usage.prompt_tokens == sum(len(p) for p in prompts)
    ids = [encode(served, p) for p in prompts]
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=3)
    assert [served.engine.request_of(response.id, i).prompt_token_ids for i in range(2)] == ids
    assert [c.text for c in response.choices] == [REPLY[:3]] * 2


def test_completion_logprobs_are_the_engines_raw_logprobs_in_openais_shape(client, served):
    response = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, logprobs=2)
    logprobs = response.choices[0].logprobs
    tokenizer = served.engine.tokenizer
    raw = [torch.log_softmax(served.engine.logits("hi", i).double(), -1) for i in range(4)]
    top2 = [torch.topk(r, 2) for r in raw]
    assert logprobs.tokens == [tokenizer.decode([int(t.indices[0])]) for t in top2]
    assert logprobs.token_logprobs == pytest.approx([float(t.values[0]) for t in top2])
    for entry, t in zip(logprobs.top_logprobs, top2, strict=True):
        expected = {tokenizer.decode([int(i)]): float(v) for i, v in zip(t.indices, t.values, strict=True)}
        assert entry == pytest.approx(expected)
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    assert logprobs.text_offset == offsets


def test_chat_logprobs_and_top_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert "".join(c.token for c in content) == REPLY[:3]
    for c in content:
        assert c.logprob == pytest.approx(0.0, abs=1e-6)
        assert c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_cover_every_token_once(client):
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=30, logprobs=1, stream=True)
    chunks = [c.choices[0] for c in stream]
    tokens = [t for c in chunks for t in c.logprobs.tokens]
    assert len(tokens) == 30
    assert "".join(c.text for c in chunks) == REPLY.encode()[:30].decode(errors="replace")


def test_echo_returns_the_prompt_before_the_completion(client, served):
    response = client.completions.create(model=MODEL, prompt="Say: ", max_tokens=5, echo=True)
    assert response.choices[0].text == "Say: " + REPLY[:5]
    ids = encode(served, "Ids: ")
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True)
    assert response.choices[0].text == "Ids: " + REPLY[:2]
    stream = client.completions.create(model=MODEL, prompt="Say: ", max_tokens=5, echo=True, stream=True)
    texts = [c.choices[0].text for c in stream]
    assert texts[0].startswith("Say: ") and "".join(texts) == "Say: " + REPLY[:5]


def test_stop_token_ids_end_the_choice_and_stay_out_of_the_text(client, served):
    bang = encode(served, "!")
    response = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=40, extra_body={"stop_token_ids": bang}
    )
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (REPLY[: REPLY.index("!")], "stop")
    assert response.usage.completion_tokens == len(REPLY[: REPLY.index("!") + 1].encode())
    assert served.engine.request_of(response.id).params.stop_token_ids == tuple(bang)


def test_min_tokens_holds_eos_back_and_ignore_eos_runs_past_it(client):
    early = client.completions.create(model=MODEL, prompt="[eos]", max_tokens=12)
    assert (early.choices[0].finish_reason, early.usage.completion_tokens) == ("stop", 5)
    held = client.completions.create(model=MODEL, prompt="[eos]", max_tokens=12, extra_body={"min_tokens": 8})
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("length", 12)
    assert held.choices[0].text == REPLY.encode()[:12].decode(errors="replace")
    ignored = client.completions.create(
        model=MODEL, prompt="[eos]", max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 12)
    assert ignored.choices[0].text == (REPLY.encode()[:4] + REPLY.encode()[5:12]).decode(errors="replace")


def test_every_sampling_field_reaches_the_engine(client, served):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=50,
        max_completion_tokens=4,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=-0.5,
        frequency_penalty=1.5,
        logit_bias={"65": 5.5},
        seed=42,
        logprobs=True,
        top_logprobs=2,
        extra_body={
            "top_k": -1,
            "min_p": 0.1,
            "repetition_penalty": 1.3,
            "min_tokens": 2,
            "stop_token_ids": [7, 7],
        },
    )
    params = served.engine.request_of(response.id).params
    assert params.max_tokens == 4
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 0, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (-0.5, 1.5, 1.3)
    assert (params.logit_bias, params.min_tokens, params.stop_token_ids) == (((65, 5.5),), 2, (7,))
    assert (params.logprobs, params.seed, served.engine.request_of(response.id).seed) == (2, 42, 42)


def test_concurrent_n_streams_each_get_their_own_text(served):
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)

    async def one(max_tokens: int) -> list[str]:
        stream = await client.completions.create(
            model=MODEL, prompt="[slow]", max_tokens=max_tokens, n=2, stream=True
        )
        texts = ["", ""]
        async for chunk in stream:
            texts[chunk.choices[0].index] += chunk.choices[0].text
        return texts

    async def many() -> list[list[str]]:
        return await asyncio.gather(*(one(n) for n in (3, 6, 9)))

    assert asyncio.run(many()) == [[REPLY.encode()[:n].decode(errors="replace")] * 2 for n in (3, 6, 9)]


def test_tokenize_and_detokenize_as_vllm(served):
    ids = encode(served, "Hello wörld")
    tokenized = httpx.post(
        f"{served.url}/tokenize", json={"prompt": "Hello wörld", "return_token_strs": True}
    ).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    assert tokenized["max_model_len"] == MAX_MODEL_LEN and len(tokenized["token_strs"]) == len(ids)
    chat = httpx.post(
        f"{served.url}/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}
    ).json()
    assert chat["tokens"] == encode(served, "user: Hello\nassistant:") and chat["token_strs"] is None
    assert httpx.post(f"{served.url}/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello wörld"}
    outside = httpx.post(f"{served.url}/detokenize", json={"tokens": [1, 10**6]})
    assert (outside.status_code, outside.json()["error"]["param"]) == (400, "tokens")
    unknown = httpx.post(f"{served.url}/tokenize", json={"prompt": "x", "model": "gpt-4"})
    assert unknown.status_code == 404


def test_an_engine_error_keeps_its_message_when_logprobs_were_asked(served):
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": "[error]", "logprobs": 1})
    assert response.status_code == 500
    assert "rank 2 lost its KV cache" in response.json()["error"]["message"]
