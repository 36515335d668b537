"""HTTP exchanges that end when the client leaves: `until_disconnect` for a handler's work and
`EventStreamResponse` for server-sent events. Free of the engine and of torch, so the router
streams with them too."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


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
