"""From an OpenAI request body to the engine's `GenerationRequest`: the served model name,
prompt tokens (plain text, token ids, or chat messages through the default template),
length limits, sampling parameters and the seed drawn at admission.

The tiny checkpoints ship a tokenizer.json but no chat template, so chat messages use one
plain default: each message as `"<role>: <content>\\n"`, then `"assistant:"` for the reply.
"""

from __future__ import annotations

import secrets

from tokenizers import Tokenizer

from elastic_ep.control.api import EngineInfo, GenerationRequest
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.model.tokenizer import encode
from elastic_ep.serve.errors import APIError, bad_request
from elastic_ep.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's legacy completions default; chat defaults to the rest of the context."""


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
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{index}] has a content part of type {part.type!r}; only text parts are supported",
                "messages",
            )
    return "".join(part.text for part in message.content)


def completion_prompt_ids(body: CompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Token ids of the one prompt of a /v1/completions body (text or ids)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise bad_request(
                f"a list of {len(prompt)} prompts is not supported; send one request per prompt", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode_text(prompt, tokenizer)
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "prompt"
        )
    return list(prompt)


def encode_text(text: str, tokenizer: Tokenizer, param: str = "prompt") -> list[int]:
    ids = encode(tokenizer, text) if text else []
    if not ids:
        raise bad_request(f"{param} is empty", param)
    return ids


def generation_request(
    request_id: str,
    prompt_ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    info: EngineInfo,
) -> GenerationRequest:
    """Check lengths, build the sampling parameters and fix the seed for the request's life
    (a recomputation after a fault must draw the same tokens)."""
    params = SamplingParams(
        max_tokens=_max_tokens(body, len(prompt_ids), info.max_model_len),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        seed=secrets.randbits(63) if body.seed is None else body.seed,
        ignore_eos=body.ignore_eos,
    )
    try:
        params.validate()
    except ValueError as e:
        raise bad_request(str(e), str(e).split()[0]) from None
    return GenerationRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, params=params, seed=params.seed
    )


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
    if requested < 1:
        raise bad_request(f"{param} must be >= 1, got {requested}", param)
    if requested > room:
        raise bad_request(
            f"the prompt has {prompt_len} tokens and {param} is {requested}: {prompt_len + requested} tokens "
            f"exceed max_model_len {max_model_len}; lower {param} to at most {room}",
            param,
        )
    return requested


def stop_strings(stop: str | list[str] | None) -> list[str]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in strings):
        raise bad_request("stop strings must not be empty", "stop")
    return strings
