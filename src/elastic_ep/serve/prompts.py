"""From an OpenAI request body to the engine's `GenerationRequest`s: the served model name,
prompts (text, token ids, lists of either, or chat messages through the default template),
length limits, sampling parameters, and one request per choice with its own seed.

The tiny checkpoints ship a tokenizer.json but no chat template, so chat messages use one
plain default: each message as `"<role>: <content>\\n"`, then `"assistant:"` for the reply.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from tokenizers import Tokenizer

from elastic_ep.control.api import EngineInfo, GenerationRequest
from elastic_ep.model.sampling import InvalidSamplingParams, SamplingParams
from elastic_ep.model.seeds import choice_seed
from elastic_ep.model.tokenizer import decode
from elastic_ep.serve.errors import APIError, bad_request
from elastic_ep.serve.protocol import MAX_CHOICES, ChatCompletionRequest, ChatMessage, CompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's legacy completions default; chat defaults to the rest of the context."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids and its text (what `echo` sends back)."""

    token_ids: list[int]
    text: str


def check_model(requested: str | None, info: EngineInfo) -> None:
    if requested is not None and requested != info.model_name:
        raise APIError(
            404,
            f"model {requested!r} does not exist on this server; it serves {info.model_name!r}",
            param="model",
            code="model_not_found",
        )


def render_chat(messages: list[ChatMessage]) -> str:
    """The default chat template (see the module docstring)."""
    if not messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    lines = [f"{m.role}: {_message_text(m, i)}\n" for i, m in enumerate(messages)]
    return "".join(lines) + "assistant:"


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    for part in message.content:
        if part.type != "text":
            raise bad_request(
                f"messages[{index}] has a content part of type {part.type!r}; only text parts are supported",
                "messages",
            )
        if part.text is None:
            raise bad_request(f"messages[{index}] has a text part without 'text'", "messages")
    return "".join(part.text for part in message.content)


def chat_prompt(body: ChatCompletionRequest, tokenizer: Tokenizer) -> Prompt:
    text = render_chat(body.messages)
    return Prompt(_nonempty(encode_text(text, tokenizer, "messages"), "messages"), text)


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> list[Prompt]:
    """The prompts of a /v1/completions body: a string, a list of strings, a list of token
    ids, or a list of token-id lists."""
    prompt = body.prompt
    if isinstance(prompt, list) and not prompt:
        raise bad_request("prompt is an empty list; send a string, token ids, or a list of prompts", "prompt")
    items = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    if len(items) * body.n > MAX_CHOICES:
        raise bad_request(
            f"{len(items)} prompts x n={body.n} is {len(items) * body.n} choices; at most {MAX_CHOICES} per request",
            "n",
        )
    return [_prompt(item, tokenizer, vocab_size) for item in items]


def _prompt(item: str | list[int], tokenizer: Tokenizer, vocab_size: int) -> Prompt:
    if isinstance(item, str):
        return Prompt(_nonempty(encode_text(item, tokenizer, "prompt"), "prompt"), item)
    _nonempty(item, "prompt")
    check_token_ids(item, vocab_size, "prompt")
    return Prompt(list(item), decode_ids(item, tokenizer, "prompt"))


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{param} token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param)


def encode_text(text: str, tokenizer: Tokenizer, param: str, add_special_tokens: bool = False) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    except (TypeError, ValueError) as e:
        # A lone surrogate (JSON "\\ud800") is valid JSON but not text the tokenizer takes.
        raise bad_request(f"{param} is not valid Unicode text ({e}); send UTF-8 text", param) from None


def _nonempty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad_request(f"{param} is empty", param)
    return ids


def decode_ids(ids: list[int], tokenizer: Tokenizer, param: str) -> str:
    try:
        return decode(tokenizer, ids)
    except (OverflowError, TypeError, ValueError) as e:
        raise bad_request(f"{param} token ids cannot be decoded: {e}", param) from None


def generation_requests(
    response_id: str,
    prompts: list[Prompt],
    body: CompletionRequest | ChatCompletionRequest,
    info: EngineInfo,
    vocab_size: int,
) -> list[GenerationRequest]:
    """One engine request per (prompt, choice), prompt-major: choice i * n + j is choice j of
    prompt i. Choice j's seed is the request's seed + j (as vLLM derives its n children),
    fixed here for the request's life, so a recomputation after a fault draws the same tokens
    and a seeded request is reproducible; greedy choices are identical."""
    _check_request_options(body, vocab_size)
    seed = secrets.randbits(63) if body.seed is None else body.seed
    named = body.resume_request_id
    requests = []
    for prompt in prompts:
        params = sampling_params(body, len(prompt.token_ids), info.max_model_len)
        resumed = _resumed_output(body, len(prompts), params, vocab_size)
        for j in range(body.n):
            index = len(requests)
            requests.append(
                GenerationRequest(
                    named or f"{response_id}-{index}", prompt.token_ids, params, choice_seed(seed, j), resumed,
                    reattach=named is not None,
                )
            )
    return requests


def reattached_response_id(request_id: str) -> str:
    """The response id a re-attach answers under: the named request's own (`<id>-<index>` without
    its index), so the client sees the id it started with."""
    head, _, index = request_id.rpartition("-")
    return head if head and index.isdigit() else request_id


def _resumed_output(
    body: CompletionRequest | ChatCompletionRequest, num_prompts: int, params: SamplingParams, vocab_size: int
) -> tuple[int, ...]:
    """`resume_output_token_ids`, checked: one choice, and something left to generate
    (`resume_request_id` also resumes one choice, from no tokens when none are given)."""
    if body.resume_request_id is not None and (body.n != 1 or num_prompts != 1):
        raise bad_request("resume_request_id re-attaches to one choice: send n=1 and one prompt", "resume_request_id")
    resumed = body.resume_output_token_ids
    if resumed is None:
        return ()
    param = "resume_output_token_ids"
    if body.n != 1 or num_prompts != 1:
        raise bad_request(f"{param} resumes one choice: send n=1 and one prompt", param)
    check_token_ids(resumed, vocab_size, param)
    if len(resumed) >= params.max_tokens:
        raise bad_request(
            f"{param} holds {len(resumed)} tokens and max_tokens is {params.max_tokens}: nothing is left to "
            "generate (max_tokens counts the resumed tokens)",
            param,
        )
    return tuple(resumed)


def _check_request_options(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    """Cross-field checks the schema cannot say."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        raise bad_request(
            "echo with logprobs asks for the prompt's logprobs, which elastic-ep does not compute; "
            "drop one of them",
            "echo",
        )
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    check_token_ids(body.stop_token_ids or [], vocab_size, "stop_token_ids")
    for key in body.logit_bias or {}:
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise bad_request(
                f"logit_bias key {key!r:.40} is not a token id in [0, {vocab_size}) written as a string",
                "logit_bias",
            )


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int
) -> SamplingParams:
    """The engine's sampling parameters for one prompt of `body` (OpenAI's defaults:
    temperature 1, top_p 1)."""
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    params = SamplingParams(
        max_tokens=_max_tokens(body, prompt_len, max_model_len),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items())),
        min_tokens=body.min_tokens,
        stop_token_ids=tuple(dict.fromkeys(body.stop_token_ids or [])),
        logprobs=logprobs,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
    )
    try:
        params.validate()
    except InvalidSamplingParams as e:
        raise bad_request(str(e), e.param) from None
    return params


def _max_tokens(body: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"the prompt has {prompt_len} tokens but max_model_len is {max_model_len}; "
            f"shorten the prompt to at most {max_model_len - 1} tokens to leave room for the reply",
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    param, requested = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        param, requested = "max_completion_tokens", body.max_completion_tokens
    if requested is None:
        return min(DEFAULT_COMPLETION_MAX_TOKENS, room) if isinstance(body, CompletionRequest) else room
    if requested > room:
        raise bad_request(
            f"the prompt has {prompt_len} tokens and {param} is {requested}: {prompt_len + requested} tokens "
            f"exceed max_model_len {max_model_len}; lower {param} to at most {room}",
            param,
        )
    return requested


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])
