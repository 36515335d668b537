"""One generation request in flight: the engine's token events turned into text deltas,
and the guarantee that the engine's iterator is closed (the engine then aborts the request
and frees its KV cache) however the HTTP exchange ends: finished, stop string, client gone,
or an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from elastic_ep.control.api import Engine, GenerationRequest, RequestOutput
from elastic_ep.serve.detokenize import TextStream
from elastic_ep.serve.errors import APIError
from elastic_ep.serve.metrics import RequestTimer

T = TypeVar("T")


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None
    """None while running; "stop", "length" or "abort" on the last delta."""


class Generation:
    def __init__(self, request: GenerationRequest, outputs: AsyncIterator[RequestOutput], text: TextStream):
        self.request = request
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
        generation = cls(request, engine.generate(request), text)
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
        the engine reports an error for this request."""
        event = self._first
        while event is not None:
            self.timer.tokens(len(event.new_token_ids))
            text = self._text.add(event.new_token_ids)
            if self._text.stopped:
                yield Delta(text, "stop")
                return
            if event.finished:
                if event.finish_reason == "error":
                    raise APIError(500, f"the engine failed this request: {event.error}", code="engine_error")
                yield Delta(text + self._text.finish(), event.finish_reason or "stop")
                return
            if text:
                yield Delta(text)
            event = await self._next()

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


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work` unless the client disconnects first; returns (finished, result).

    Starlette does not cancel a handler whose client left, so a long non-streaming
    generation would otherwise keep running for nobody.
    """
    outcome: list[tuple[bool, object]] = []
    async with anyio.create_task_group() as group:

        async def run_work() -> None:
            # Kept out of the task group so the caller sees the error itself, not a group.
            try:
                outcome.append((True, await work()))
            except Exception as e:
                outcome.append((False, e))
            group.cancel_scope.cancel()

        group.start_soon(run_work)
        while (await receive())["type"] != "http.disconnect":
            pass
        group.cancel_scope.cancel()
    if not outcome:
        return False, None
    ok, value = outcome[0]
    if not ok:
        raise value
    return True, value


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop, and call `on_close`, as soon as the client disconnects,
    even while no event is being produced (a stalled step)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:
                pass

        try:
            await until_disconnect(receive, stream)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._on_close()
