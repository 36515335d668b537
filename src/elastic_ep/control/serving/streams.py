"""The request streams the control thread feeds: a request's tokens go from the step that sampled
them to the HTTP handler awaiting them on its event loop.

A rank's death never ends a stream: its sequences move to another rank and the stream only
pauses. A stream ends with an error only when its request cannot be served (the cluster stayed
too small for --degraded-timeout-s, or its step keeps failing with every rank alive).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..api import RequestOutput
from ..tracing import RequestTraces
from .scheduler import Scheduler


@dataclass
class Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class Streams:
    """seq_id -> the stream of its request (control thread only); `traces` hears of every end."""

    def __init__(self, scheduler: Scheduler, traces: RequestTraces | None = None):
        self.scheduler = scheduler
        self.traces = traces
        self._streams: dict[int, Stream] = {}

    def add(self, seq_id: int, stream: Stream) -> None:
        self._streams[seq_id] = stream

    def drop(self, seq_id: int) -> None:
        self._streams.pop(seq_id, None)

    def __iter__(self):
        return iter(list(self._streams.items()))

    def deliver(self, seq_id: int, out: RequestOutput) -> None:
        """Hand `out` to the request's event loop; a stream whose loop is gone aborts its request."""
        stream = self._streams.get(seq_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[seq_id]
            if self.traces is not None:
                self.traces.finished(seq_id, out.finish_reason or "stop")
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:
            self.scheduler.abort(seq_id)

    def end_with_error(self, seq_id: int, error: str) -> None:
        """Abort the sequence and finish its stream with `error`."""
        seq = self.scheduler.by_id.get(seq_id)
        if seq is not None:
            self.scheduler.abort(seq_id)
            self.deliver(seq_id, RequestOutput(seq.request.request_id, [], True, "error", error))
