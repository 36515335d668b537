"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (streaming or not)
and /v1/models. Tokenization, the chat template, detokenization and stop strings happen
here; the engine only sees token ids.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from tokenizers import Tokenizer

from elastic_ep.control.api import Engine
from elastic_ep.serve.detokenize import TextStream
from elastic_ep.serve.errors import APIError, error_body
from elastic_ep.serve.generation import Delta, EventStreamResponse, Generation, until_disconnect
from elastic_ep.serve.metrics import HttpMetrics, RequestTimer
from elastic_ep.serve.prompts import (
    check_model,
    completion_prompt_ids,
    encode_text,
    generation_request,
    render_chat,
    stop_strings,
)
from elastic_ep.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    refuse_unsupported,
)

logger = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499
"""Recorded (nginx's convention) when a client left before its answer started."""


def openai_router(engine: Engine, tokenizer: Tokenizer, metrics: HttpMetrics) -> APIRouter:
    router = APIRouter()
    info = engine.info
    vocab_size = int(info.extra.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True))
    created_s = int(time.time())

    @router.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": info.model_name,
            "object": "model",
            "created": created_s,
            "owned_by": "elastic-ep",
            "max_model_len": info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _respond(request, _COMPLETION)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _respond(request, _CHAT)

    async def _respond(request: Request, kind: _Kind) -> Response:
        timer = RequestTimer(metrics)
        body = parse_body(await request.body(), ChatCompletionRequest if kind.chat else CompletionRequest)
        check_model(body.model, info)
        refuse_unsupported(body)
        if isinstance(body, ChatCompletionRequest):
            prompt_ids = encode_text(render_chat(body.messages), tokenizer, "messages")
        else:
            prompt_ids = completion_prompt_ids(body, tokenizer, vocab_size)
        stops = stop_strings(body.stop)
        gen_request = generation_request(f"{kind.id_prefix}-{uuid.uuid4().hex}", prompt_ids, body, info)
        text = TextStream(tokenizer, stops, hidden_token_ids=info.eos_token_ids)
        # A client may leave while the engine is still admitting (a cluster that recovers):
        # the wait is cancelled, which aborts the request in the engine.
        admitted, generation = await until_disconnect(
            request.receive, lambda: Generation.admit(engine, gen_request, text, timer)
        )
        if not admitted:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        head = {"id": gen_request.request_id, "created": int(time.time()), "model": info.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _sse_events(generation, kind, head, include_usage)
            return EventStreamResponse(events, on_close=generation.close)
        try:
            finished, deltas = await until_disconnect(request.receive, lambda: _collect(generation))
        finally:
            await generation.close()
        if not finished:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        text_out = "".join(d.text for d in deltas)
        choice = kind.final_choice(text_out, deltas[-1].finish_reason)
        usage = _usage(generation)
        return JSONResponse({**head, "object": kind.object, "choices": [choice], "usage": usage})

    return router


async def _collect(generation: Generation) -> list[Delta]:
    return [delta async for delta in generation.deltas()]


async def _sse_events(
    generation: Generation, kind: _Kind, head: dict, include_usage: bool
) -> AsyncIterator[str]:
    chunk_head = {**head, "object": kind.chunk_object}
    extra = {"usage": None} if include_usage else {}
    try:
        if kind.chat:
            yield _sse({**chunk_head, "choices": [kind.chunk_choice("", None, role=True)], **extra})
        async for delta in generation.deltas():
            yield _sse(
                {**chunk_head, "choices": [kind.chunk_choice(delta.text, delta.finish_reason)], **extra}
            )
        if include_usage:
            yield _sse({**chunk_head, "choices": [], "usage": _usage(generation)})
    except APIError as e:
        yield _sse(error_body(e.status, e.message, e.param, e.code))
    except Exception as e:
        # Headers are gone already: the error can only travel as an event.
        logger.exception("stream of %s failed", generation.request.request_id)
        yield _sse(error_body(500, f"internal error: {type(e).__name__}: {e}"))
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(generation: Generation) -> dict:
    prompt = len(generation.request.prompt_token_ids)
    completion = generation.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class _Kind:
    """What differs between completions and chat: ids, object names and choice shapes."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def final_choice(self, text: str, finish_reason: str | None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        delta = {"content": text} if text or finish_reason is None else {}
        if role:
            delta = {"role": "assistant", **delta}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


_COMPLETION = _Kind("cmpl", "text_completion", "text_completion", chat=False)
_CHAT = _Kind("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)
