"""The OpenAI-compatible routes: /v1/completions and /v1/chat/completions (streaming or not,
n choices, lists of prompts, logprobs, echo), /v1/models and /v1/models/{id}, and vLLM's
/tokenize and /detokenize. Tokenization, the chat template, detokenization and stop strings happen here;
the engine only sees token ids, one engine request per choice.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel
from tokenizers import Tokenizer

from elastic_ep.control.api import Engine
from elastic_ep.serve.detokenize import TextStream
from elastic_ep.serve.errors import APIError, error_body
from elastic_ep.serve.generation import (
    Delta,
    Generation,
    TextLogprob,
    admit_all,
    close_all,
    collect,
    merge,
)
from elastic_ep.serve.metrics import HttpMetrics, RequestTimer
from elastic_ep.serve.openapi import error_responses, event_stream_response
from elastic_ep.serve.prefix_keys import HEADER as PREFIX_KEY_HEADER
from elastic_ep.serve.prefix_keys import KeyRecorder
from elastic_ep.serve.prompts import (
    Prompt,
    chat_prompt,
    check_model,
    check_token_ids,
    completion_prompts,
    decode_ids,
    encode_text,
    generation_requests,
    reattached_response_id,
    render_chat,
    stop_strings,
)
from elastic_ep.serve.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
)
from elastic_ep.serve.response_ids import response_id as named_response_id
from elastic_ep.serve.streaming import EventStreamResponse, until_disconnect

logger = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499
"""Recorded (nginx's convention) when a client left before its answer started."""


def openai_router(engine: Engine, tokenizer: Tokenizer, metrics: HttpMetrics,
                  prefix_keys: KeyRecorder | None = None) -> APIRouter:
    """`prefix_keys`: where the prefix key a router names in a generation request is counted."""
    router = APIRouter()
    info = engine.info
    vocab_size = int(info.extra.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True))
    created_s = int(time.time())

    card = ModelCard(
        id=info.model_name,
        created=created_s,
        owned_by="elastic-ep",
        root=info.model_name,
        max_model_len=info.max_model_len,
    )

    @router.get("/v1/models", response_model=ModelList, responses=error_responses(500))
    async def models() -> ModelList:
        return ModelList(data=[card])

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(404, 500))
    async def model(model_id: str) -> ModelCard:
        """The served model's card (OpenAI's `models.retrieve`); 404 for any other id."""
        check_model(model_id, info)
        return card

    @router.post(
        "/v1/completions", response_model=CompletionResponse, responses=_answers(CompletionStreamResponse)
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model, info)
        prompts = completion_prompts(body, tokenizer, vocab_size)
        return await _respond(request, body, prompts, _COMPLETION)

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=_answers(ChatCompletionStreamResponse),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model, info)
        return await _respond(request, body, [chat_prompt(body, tokenizer)], _CHAT)

    @router.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 404, 500))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model, info)
        if isinstance(body, TokenizeChatRequest):
            text = render_chat(body.messages) if body.add_generation_prompt else _chat_text(body)
            ids = encode_text(text, tokenizer, "messages")
        else:
            ids = encode_text(body.prompt, tokenizer, "prompt", body.add_special_tokens)
        strs = [tokenizer.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids, token_strs=strs)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 404, 500))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model, info)
        check_token_ids(body.tokens, vocab_size, "tokens")
        return DetokenizeResponse(prompt=decode_ids(body.tokens, tokenizer, "tokens"))

    async def _respond(
        request: Request, body: CompletionRequest | ChatCompletionRequest, prompts: list[Prompt], kind: _Kind
    ) -> Response:
        # vLLM's behaviour: the client may name the request (X-Request-Id), else a fresh id
        response_id = named_response_id(kind.route, request.headers.get("x-request-id") or uuid.uuid4().hex)
        if body.resume_request_id is not None:
            response_id = reattached_response_id(body.resume_request_id)
        if prefix_keys is not None:
            prefix_keys.record(request.headers.get(PREFIX_KEY_HEADER))
        gen_requests = generation_requests(response_id, prompts, body, info, vocab_size)
        stops = stop_strings(body.stop)
        hidden = (*info.eos_token_ids, *(body.stop_token_ids or []))
        texts = [TextStream(tokenizer, stops, hidden_token_ids=hidden) for _ in gen_requests]
        for text, gen_request in zip(texts, gen_requests, strict=True):
            text.resume(list(gen_request.resumed_output_token_ids))
        timers = [RequestTimer(metrics) for _ in gen_requests]
        # A client may leave while the engine is still admitting (a cluster that recovers):
        # the wait is cancelled, which aborts the requests in the engine.
        admitted, generations = await until_disconnect(
            request.receive, lambda: admit_all(engine, gen_requests, texts, timers)
        )
        if not admitted:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        echo = getattr(body, "echo", False) and body.resume_output_token_ids is None and body.resume_request_id is None
        per_choice = [p for p in prompts for _ in range(body.n)]
        choices = [
            _Choice(i, p.text if echo else "", g, p.token_ids if body.return_token_ids else None)
            for i, (p, g) in enumerate(zip(per_choice, generations, strict=True))
        ]
        usage = _Usage(sum(len(p.token_ids) for p in prompts), generations)
        head = {"id": response_id, "created": int(time.time()), "model": info.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _sse_events(choices, kind, head, usage if include_usage else None)
            return EventStreamResponse(events, on_close=lambda: close_all(generations))
        try:
            finished, deltas = await until_disconnect(request.receive, lambda: collect(generations))
        finally:
            await close_all(generations)
        if not finished:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        with_logprobs = gen_requests[0].params.logprobs is not None
        final = [kind.final_choice(c, ds, with_logprobs) for c, ds in zip(choices, deltas, strict=True)]
        response = kind.response(**head, choices=final, usage=usage.model())
        return Response(response.model_dump_json(), media_type="application/json")

    return router


def _answers(event: type[BaseModel]) -> dict[int | str, dict]:
    """The documented answers of a completions route besides its JSON 200."""
    return {200: event_stream_response(event), **error_responses(400, 404, 409, 500, 503)}


def _chat_text(body: TokenizeChatRequest) -> str:
    """The chat template without the trailing generation prompt."""
    return render_chat(body.messages).removesuffix("assistant:")


@dataclass
class _Choice:
    """One choice of a response: its index, the echoed prompt still to send, its prompt's token
    ids still to send (None: the request did not ask for token ids), and the offset of its next
    token in its text (completions logprobs)."""

    index: int
    echo: str
    generation: Generation
    prompt_token_ids: list[int] | None
    text_offset: int = 0
    prompt_ids_sent: bool = False

    @property
    def with_token_ids(self) -> bool:
        return self.prompt_token_ids is not None

    def take_echo(self) -> str:
        echo, self.echo = self.echo, ""
        return echo

    def take_prompt_ids(self) -> list[int] | None:
        """The prompt's token ids the first time (for the first chunk of the choice), else None."""
        if self.prompt_ids_sent:
            return None
        self.prompt_ids_sent = True
        return self.prompt_token_ids

    def token_ids(self, deltas: list[Delta]) -> list[int] | None:
        return [t for d in deltas for t in d.token_ids] if self.with_token_ids else None


@dataclass(frozen=True)
class _Usage:
    prompt_tokens: int
    generations: list[Generation]

    def model(self) -> Usage:
        completion = sum(g.completion_tokens for g in self.generations)
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
        )


async def _sse_events(
    choices: list[_Choice], kind: _Kind, head: dict, usage: _Usage | None
) -> AsyncIterator[str]:
    try:
        if kind.chat:
            for c in choices:
                first = ChatStreamChoice(
                    index=c.index,
                    delta=ChatDelta(role="assistant", content=""),
                    logprobs=None,
                    finish_reason=None,
                    prompt_token_ids=c.take_prompt_ids(),
                )
                yield _sse(kind.chunk(**head, choices=[first]))
        with_logprobs = choices[0].generation.request.params.logprobs is not None
        async with aclosing(merge([c.generation for c in choices])) as deltas:
            async for i, delta in deltas:
                yield _sse(kind.chunk(**head, choices=[kind.chunk_choice(choices[i], delta, with_logprobs)]))
        if usage is not None:
            yield _sse(kind.chunk(**head, choices=[], usage=usage.model()))
    except APIError as e:
        yield _sse_error(error_body(e.status, e.message, e.param, e.code))
    except Exception as e:
        # Headers are gone already: the error can only travel as an event.
        logger.exception("stream %s failed", head["id"])
        yield _sse_error(error_body(500, f"internal error: {type(e).__name__}: {e}"))
    yield "data: [DONE]\n\n"


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def _sse_error(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _completion_logprobs(choice: _Choice, entries: list[TextLogprob]) -> CompletionLogprobs:
    """OpenAI's completions shape; top_logprobs holds the top N and the token itself, as vLLM."""
    offsets = []
    for entry in entries:
        offsets.append(choice.text_offset)
        choice.text_offset += len(entry.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[dict([*e.top, (e.token, e.logprob)]) for e in entries],
        text_offset=offsets,
    )


def _chat_logprobs(entries: list[TextLogprob]) -> ChatChoiceLogprobs:
    def top(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8", errors="replace")))

    content = [
        ChatTokenLogprob(**top(e.token, e.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in e.top])
        for e in entries
    ]
    return ChatChoiceLogprobs(content=content)


@dataclass(frozen=True)
class _Kind:
    """What differs between completions and chat: ids, response models and choice shapes."""

    route: str  # "completion" or "chat": its response ids (prompts.py `response_id`)
    chat: bool
    response: type[CompletionResponse] | type[ChatCompletionResponse]
    chunk: type[CompletionStreamResponse] | type[ChatCompletionStreamResponse]

    def final_choice(
        self, choice: _Choice, deltas: list[Delta], with_logprobs: bool
    ) -> CompletionChoice | ChatChoice:
        entries = [e for d in deltas for e in d.logprobs]
        text = "".join(d.text for d in deltas)
        reason = deltas[-1].finish_reason
        if self.chat:
            logprobs = _chat_logprobs(entries) if with_logprobs else None
            return ChatChoice(
                index=choice.index,
                message=ChatResponseMessage(content=text),
                logprobs=logprobs,
                finish_reason=reason,
                token_ids=choice.token_ids(deltas),
                prompt_token_ids=choice.take_prompt_ids(),
                stop_reason=deltas[-1].stop_reason,
            )
        echo = choice.take_echo()
        choice.text_offset = len(echo)
        logprobs = _completion_logprobs(choice, entries) if with_logprobs else None
        return CompletionChoice(
            index=choice.index,
            text=echo + text,
            logprobs=logprobs,
            finish_reason=reason,
            token_ids=choice.token_ids(deltas),
            prompt_token_ids=choice.take_prompt_ids(),
            stop_reason=deltas[-1].stop_reason,
        )

    def chunk_choice(
        self, choice: _Choice, delta: Delta, with_logprobs: bool
    ) -> CompletionChoice | ChatStreamChoice:
        if self.chat:
            content = (
                ChatDelta(content=delta.text) if delta.text or delta.finish_reason is None else ChatDelta()
            )
            logprobs = _chat_logprobs(delta.logprobs) if with_logprobs else None
            return ChatStreamChoice(
                index=choice.index,
                delta=content,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                token_ids=choice.token_ids([delta]),
                prompt_token_ids=choice.take_prompt_ids(),
                stop_reason=delta.stop_reason,
            )
        echo = choice.take_echo()
        choice.text_offset += len(echo)
        logprobs = _completion_logprobs(choice, delta.logprobs) if with_logprobs else None
        return CompletionChoice(
            index=choice.index,
            text=echo + delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            token_ids=choice.token_ids([delta]),
            prompt_token_ids=choice.take_prompt_ids(),
            stop_reason=delta.stop_reason,
        )


_COMPLETION = _Kind("completion", False, CompletionResponse, CompletionStreamResponse)
_CHAT = _Kind("chat", True, ChatCompletionResponse, ChatCompletionStreamResponse)
