"""Request and response bodies of every route as pydantic models. The handlers validate with
them and /openapi.json is generated from them, so the two cannot disagree.

Requests are strict: "5" is not an int, true is not a number, NaN and ±Infinity (which
Python's JSON parser accepts) are not numbers, every range is in the schema, and a field the
server does not implement (tools, response_format, suffix, ...) is refused by name rather
than silently ignored (`extra="forbid"`). Ranges follow vLLM's checks; the limits shared with
the sampler live in `model.sampling`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from elastic_ep.model.sampling import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
)

MAX_CHOICES = 128
"""Most choices one request may ask for: n, and n times the number of prompts."""

MAX_TOP_K = 2**31 - 1
"""top_k fits a signed 32-bit integer, so an engine may put it in a tensor."""

FinishReason = Literal["stop", "length", "abort"]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


TokenId = Annotated[int, Field(ge=0)]
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
"""Bounds on `stop`, which is searched after every token on the server's event loop."""
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Penalty = Annotated[float, Field(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)]


class _SamplingBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's
    extensions: top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description="at most max_model_len minus the prompt")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(
        None, ge=-1, le=MAX_TOP_K, description="0 or -1 = off; above the vocabulary = all"
    )
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]] | None = (
        Field(None, description="token id (as a string) -> bias added to its logit")
    )
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="the text ends before the first of these strings"
    )
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int = Field(
        0, ge=0, description="EOS and stop_token_ids are not drawn before this many tokens"
    )
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = Field(
        False,
        description="extension (vLLM's name): every choice carries `token_ids`, the tokens behind its text, "
        "and the first chunk (or the answer) of each choice `prompt_token_ids`",
    )
    resume_output_token_ids: list[TokenId] | None = Field(
        None,
        description="extension: the tokens this choice already generated elsewhere (a stream resumed after "
        "its instance died; needs n=1 and one prompt). The answer goes on exactly where they end: they count "
        "as output for penalties, min_tokens and max_tokens, sampling positions follow them, the text starts "
        "after theirs and is not echoed; usage counts only the tokens generated here",
    )
    resume_request_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9._:~-]+$",
        description="extension: re-attach to a request by its id, `<id>-<index>` (the response's `id`, the "
        "choice's index; GET /journal/{id} names it `request_id`), with resume_output_token_ids = the tokens "
        "already received (same prompt, seed and parameters; n=1). A controller that runs or holds that request "
        "(a new leader of a controller group goes on with the last one's requests) answers from it with the "
        "tokens after those, instead of a second copy; one that does not runs it anew under that id. 409 when "
        "the tokens, prompt, seed or parameters disagree with the request it holds",
    )


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="one prompt (text or token ids) or a list of prompts; choices are indexed "
        "prompt-major: prompt i, choice j has index i * n + j"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top logprobs per token")
    echo: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, description="takes precedence over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(
        False, description="the completions routes add none, so the default shows what they run"
    )
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    return_token_strs: bool = False


def _tokenize_kind(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


RankId = Annotated[int, Field(ge=0, le=1_000_000)]


class ScaleRequest(_Body):
    new_ep_size: int = Field(ge=1)
    ranks: list[RankId] | None = Field(
        None, max_length=4096, description="a scale-down: the ranks that leave (default: the highest ids)")


class DrainRequest(_Body):
    ranks: list[RankId] | None = Field(None, max_length=4096, description="the ranks to drain (ids in GET /cluster)")
    node: str | None = Field(None, max_length=256, description="a node to cordon and drain of every rank")


class RollingRestartRequest(_Body):
    """What the new processes start with; a field left out keeps its value (control/membership/rollout_rules.py)."""

    model: str | None = Field(None, min_length=1, max_length=4096,
                              description="a checkpoint directory of the same model (config, tensor names, dtypes "
                                          "and shapes as served) to read from, e.g. after moving it to local disks")
    kv_cache_memory: int | None = Field(None, ge=0, description="bytes of each rank's KV pool (serve's flag)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="serve's --gpu-memory-utilization")
    num_gpu_blocks_override: int | None = Field(None, ge=0, description="serve's --num-gpu-blocks-override")


class UncordonRequest(_Body):
    node: str = Field(max_length=256, description="a node drained with POST /drain")


class ChaosRequest(_Body):
    rank_id: int | None = Field(None, ge=0, description="the rank (every action but poison, and cut / heal of a node)")
    node: str | None = Field(None, max_length=256, description="cut / heal: a whole node (an `elastic-ep agent`)")
    duration_s: float = Field(0.0, ge=0, le=3600, description="cut: heal by itself after this long (0: only on heal)")
    delay_s: float = Field(0.0, ge=0, le=3600)
    layer: int | None = Field(None, description="corrupt: the MoE layer index of the slot")
    slot: int | None = Field(None, description="corrupt: the slot within the rank")
    at_next_epoch: bool = Field(False, description="kill / hang: right after the next epoch is announced")
    request_id: str | None = Field(None, max_length=256, description="poison: the id of a running request")
    phase: Literal["local", "experts", "sampling"] = Field(
        "local", description="poison: where the request's steps raise on its rank")


# ---- responses ----------------------------------------------------------------------------


_ABSENT_IF_NONE = {"default": None, "exclude_if": lambda value: value is None}
"""A field sent only when set (return_token_ids' fields, usage in the last event)."""


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx, as OpenAI sends it; `param` names the offending field."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, logprob, the top logprobs by text (the top N plus the
    token itself), and the offset of the token in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


StopReason = Annotated[
    str | int | None,
    Field(description="vLLM's: the stop string or stop token id that ended the choice; null for EOS, a length "
                      "limit, or while it runs"),
]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = Field(**_ABSENT_IF_NONE)
    prompt_token_ids: list[int] | None = Field(**_ABSENT_IF_NONE)
    stop_reason: StopReason = None


class _Answer(BaseModel):
    """What every completion answer and stream event starts with."""

    id: str
    created: int
    model: str


class CompletionResponse(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(_Answer):
    """One server-sent event of a streamed completion; `usage` only in the last event, and
    only with stream_options.include_usage."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = Field(**_ABSENT_IF_NONE)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = Field(**_ABSENT_IF_NONE)
    prompt_token_ids: list[int] | None = Field(**_ABSENT_IF_NONE)
    stop_reason: StopReason = None


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """The first event of each choice carries the role, the last one may carry no content."""

    role: Literal["assistant"] | None = Field(**_ABSENT_IF_NONE)
    content: str | None = Field(**_ABSENT_IF_NONE)


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = Field(**_ABSENT_IF_NONE)
    prompt_token_ids: list[int] | None = Field(**_ABSENT_IF_NONE)
    stop_reason: StopReason = None


class ChatCompletionStreamResponse(_Answer):
    """One server-sent event of a streamed chat completion (see CompletionStreamResponse)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = Field(**_ABSENT_IF_NONE)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    """ok; degraded (serving or about to, not at full strength: `reason` says why); dead (503)."""

    status: Literal["ok", "degraded", "dead"] = "ok"
    reason: str = ""
    role: Literal["leader", "standby", "deposed"] | None = None  # in a controller group (serve --etcd) only


class VersionResponse(BaseModel):
    version: str


class ReadyResponse(BaseModel):
    ready: bool
    reason: str


class ScaleResponse(BaseModel):
    old_ep_size: int
    new_ep_size: int


class DrainResponse(BaseModel):
    ranks: list[int]
    node: str | None
    old_ep_size: int
    new_ep_size: int


class UncordonResponse(BaseModel):
    node: str
    cordoned: bool


class RecorderResponse(BaseModel):
    status: Literal["recording", "stopped"]
