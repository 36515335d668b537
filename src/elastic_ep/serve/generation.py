"""Generation requests in flight: the engine's token events turned into text deltas (with
their tokens' logprobs), and the guarantee that every engine iterator is closed (the engine
then aborts the request and frees its KV cache) however the HTTP exchange ends: finished,
stop string, client gone, or an error.

A request with several choices (n, or a list of prompts) is several engine requests:
`admit_all` starts them together and `merge` interleaves their deltas for a stream. A failure
in one request's own text handling (a token the tokenizer cannot decode, a stop string that
breaks) ends that HTTP request with a `detokenization_error` and aborts its engine requests;
the server and every other request go on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from elastic_ep.control.api import Engine, GenerationRequest, RequestOutput
from elastic_ep.serve.detokenize import TextStream
from elastic_ep.serve.errors import APIError
from elastic_ep.serve.metrics import RequestTimer

T = TypeVar("T")

MIN_LOGPROB = -9999.0
"""A logprob of -inf is sent as this (JSON has no infinity; OpenAI and vLLM do the same)."""


@dataclass(frozen=True)
class TextLogprob:
    """One generated token's logprob and its top alternatives, as text."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None
    """None while running; "stop", "length" or "abort" on the last delta."""
    logprobs: list[TextLogprob] = field(default_factory=list)
    """The tokens behind this delta (and any whose text was held back before), when the
    request asked for logprobs."""
    token_ids: list[int] = field(default_factory=list)
    """The ids of the tokens behind this delta (and any whose text was held back before)."""
    stop_reason: str | int | None = None
    """vLLM's meaning, on the last delta: the stop string or stop token id that ended it; None
    for EOS, a length limit, or while running."""


class Generation:
    def __init__(self, request: GenerationRequest, outputs: AsyncIterator[RequestOutput], text: TextStream,
                 eos_token_ids: tuple[int, ...] = ()):
        self.request = request
        params = request.params
        # as vLLM: EOS (unless ignored) ends a request before stop_token_ids are looked at
        self._stop_tokens = frozenset(params.stop_token_ids) - frozenset(() if params.ignore_eos else eos_token_ids)
        self._outputs = outputs
        self._text = text
        self._first: RequestOutput | None = None
        self._closed = False
        self.timer: RequestTimer | None = None

    @classmethod
    async def admit(
        cls, engine: Engine, request: GenerationRequest, text: TextStream, timer: RequestTimer
    ) -> Generation:
        """Start the request and wait for its first event, so that ServiceUnavailable (an
        async generator raises it on the first `__anext__`) is still answered with a 503
        before any response header is sent."""
        generation = cls(request, engine.generate(request), text, engine.info.eos_token_ids)
        try:
            generation._first = await generation._next()
        except BaseException:
            await generation.close()
            raise
        generation.timer = timer
        timer.admit(len(request.prompt_token_ids))
        return generation

    @property
    def completion_tokens(self) -> int:
        return self.timer.generated if self.timer else 0

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas, the last one with its finish_reason. Raises APIError(500) when
        the engine reports an error for this request or its text cannot be made."""
        event = self._first
        held: list[TextLogprob] = []
        held_ids: list[int] = []
        while event is not None:
            self.timer.tokens(len(event.new_token_ids))
            held += self._logprobs(event)
            held_ids += event.new_token_ids
            text = self._guarded(lambda e=event: self._text.add(e.new_token_ids))
            if self._text.stopped:
                self.timer.ended("stop")
                yield Delta(text, "stop", held, held_ids, stop_reason=self._text.stop_string)
                return
            if event.finished:
                if event.finish_reason == "error":
                    self.timer.ended("error")
                    raise APIError(500, f"the engine failed this request: {event.error}", code="engine_error")
                self.timer.ended(event.finish_reason or "stop")
                last = event.new_token_ids[-1] if event.new_token_ids else None
                stop_token = last if event.finish_reason == "stop" and last in self._stop_tokens else None
                yield Delta(text + self._guarded(self._text.finish), event.finish_reason or "stop", held, held_ids,
                            stop_reason=stop_token)
                return
            if text:
                yield Delta(text, None, held, held_ids)
                held, held_ids = [], []
            event = await self._next()

    def _logprobs(self, event: RequestOutput) -> list[TextLogprob]:
        if self.request.params.logprobs is None or not event.new_token_ids:
            return []
        if event.logprobs is None or len(event.logprobs) != len(event.new_token_ids):
            raise APIError(
                500,
                f"the engine sent {len(event.logprobs or [])} logprobs for {len(event.new_token_ids)} tokens "
                f"of request {self.request.request_id}, which asked for logprobs",
                code="engine_error",
            )
        text = self._text.token_text
        return self._guarded(
            lambda: [
                TextLogprob(
                    text(token),
                    max(lp.logprob, MIN_LOGPROB),
                    [(text(t), max(v, MIN_LOGPROB)) for t, v in lp.top],
                )
                for token, lp in zip(event.new_token_ids, event.logprobs, strict=True)
            ]
        )

    def _guarded(self, step: Callable[[], T]) -> T:
        try:
            return step()
        except Exception as e:
            if self.timer is not None:
                self.timer.ended("error")
            raise APIError(
                500,
                f"turning the tokens of request {self.request.request_id} into text failed "
                f"({type(e).__name__}: {e}); this request was ended, the server goes on",
                code="detokenization_error",
            ) from e

    async def _next(self) -> RequestOutput:
        try:
            return await self._outputs.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(
                f"the engine ended request {self.request.request_id} without a finished event"
            ) from None

    async def close(self) -> None:
        """Close the engine's iterator (idempotent). Shielded: it runs when the client has
        gone and the handler is being cancelled, which is exactly when the abort matters."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._outputs, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.timer is not None:
                self.timer.finish()


async def admit_all(
    engine: Engine, requests: list[GenerationRequest], texts: list[TextStream], timers: list[RequestTimer]
) -> list[Generation]:
    """Admit every request at once; if one is refused (or the wait is cancelled), the ones
    already admitted are closed and the error is raised."""
    admitted: list[Generation] = []

    async def admit(request: GenerationRequest, text: TextStream, timer: RequestTimer) -> Generation:
        generation = await Generation.admit(engine, request, text, timer)
        admitted.append(generation)
        return generation

    try:
        return await run_all([admit(*args) for args in zip(requests, texts, timers, strict=True)])
    except BaseException:
        await close_all(admitted)
        raise


async def close_all(generations: list[Generation]) -> None:
    with anyio.CancelScope(shield=True):
        for generation in generations:
            await generation.close()


async def collect(generations: list[Generation]) -> list[list[Delta]]:
    """Every delta of every generation, in the order of `generations`."""

    async def one(generation: Generation) -> list[Delta]:
        return [delta async for delta in generation.deltas()]

    return await run_all([one(g) for g in generations])


async def run_all(coroutines: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently. When one raises, or this is cancelled, the others are cancelled and
    waited for before the error propagates (an engine iterator must not be closed while a
    task still reads it)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait(tasks)
        raise


async def merge(generations: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """(index in `generations`, delta) as each delta arrives. Closing this iterator cancels
    the pending reads."""
    streams = [g.deltas() for g in generations]
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                yield i, delta
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        if pending:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(pending)
