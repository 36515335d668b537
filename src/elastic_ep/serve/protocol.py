"""Request bodies of the OpenAI API as pydantic models, and the parsing that turns a raw
body into one (malformed JSON and wrong types become a 400 naming the field).

Only what the engine can honour is accepted: `n` > 1, `logprobs`, `echo`, `best_of`,
penalties, `logit_bias` and tools are refused with a message rather than silently ignored.
Unknown fields are ignored, as most OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from elastic_ep.serve.errors import bad_request


class _Body(BaseModel):
    # strict: "5" is not an int and true is not a number; a client bug should be a 400.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extension (as in vLLM): keep generating past EOS, for benchmarks.
    ignore_eos: bool = False


class CompletionRequest(_SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None


class ScaleRequest(_Body):
    new_ep_size: int


class ChaosRequest(_Body):
    rank_id: int
    delay_s: float = 0.0
    layer: int | None = None  # corrupt: the MoE layer index of the slot
    slot: int | None = None  # corrupt: the slot within the rank
    at_next_epoch: bool = False  # kill / hang: right after the next epoch is announced


Body = TypeVar("Body", bound=_Body)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """Validate a JSON body; any problem is a 400 that names the field and what was wrong."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"malformed JSON body: {first['msg']}") from None
        param = ".".join(str(part) for part in first["loc"] if not _is_union_branch(part))
        where = f"field {param!r}" if param else "request body"
        raise bad_request(
            f"invalid {where}: {first['msg']} (got {first.get('input')!r:.80})", param or None
        ) from None


def _is_union_branch(part: object) -> bool:
    """pydantic names the union member it tried (`prompt.str`, `stop.list[str]`) in the
    location; the user only needs the field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for options the engine cannot honour, so the client does not get a silently
    different answer than it asked for."""
    if body.n is not None and body.n != 1:
        raise bad_request(f"n={body.n} is not supported: elastic-ep returns exactly one choice (n=1)", "n")
    if body.presence_penalty or body.frequency_penalty:
        param = "presence_penalty" if body.presence_penalty else "frequency_penalty"
        raise bad_request(f"{param} is not supported; leave it unset or 0", param)
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None:
            raise bad_request("logprobs is not supported by elastic-ep; leave it unset", "logprobs")
        if body.echo:
            raise bad_request("echo is not supported", "echo")
        if body.best_of is not None and body.best_of != 1:
            raise bad_request("best_of > 1 is not supported", "best_of")
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
    else:
        if body.logprobs or body.top_logprobs:
            raise bad_request("logprobs is not supported by elastic-ep; leave it unset", "logprobs")
        if body.tools:
            raise bad_request("tools (function calling) are not supported", "tools")
