"""The request streams the control thread feeds: a request's tokens go from the step that sampled
them to the HTTP handler awaiting them on its event loop.

A step's tokens cross to each event loop in one hand-over (one `call_soon_threadsafe`: one lock
and one write to the loop's self-pipe per loop per step, not per sequence), and the loop builds
the `RequestOutput`s: the control thread only gathers tuples. Hand-overs to a loop run in the
order they were made, so a stream's outputs keep their order across steps.

A request of an API server process (`serve --api-server-count N`) has a `RemoteStream`: a step's
outputs of one server's requests are gathered straight into the columns of one `StreamOutputs`
frame to that server (`ServerOutputs.send`, control/facade/api_bridge.py), and that process builds
the outputs, so no token of theirs wakes an event loop of this process.

A rank's death never ends a stream: its sequences move to another rank and the stream only
pauses. A stream ends with an error only when its request cannot be served (the cluster stayed
too small for --degraded-timeout-s, or its step keeps failing with every rank alive).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from elastic_ep.wire.api_server import StreamOutputs

from ..api import RequestOutput
from ..tracing import RequestTraces
from .scheduler import Scheduler, StepTokens

# What a loop is handed per output: (seq_id, its queue, RequestOutput's fields in order).
_Handed = tuple[int, asyncio.Queue, tuple]


@dataclass
class Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class RemoteStream:
    """A request of API server process `server`, which knows it as `key`."""

    request_id: str
    server: int
    key: int


class ServerOutputs(Protocol):
    def send(self, server: int, outputs: StreamOutputs) -> bool:
        """One step's outputs to API server `server`; False when it cannot take them (gone)."""
        ...


@dataclass
class _Route:
    """Where the outputs of a rank's column of sequences (`seq_ids`) go, worked out once for as long
    as the column is the same: per API server (server, the column's indices of its requests, their
    keys, their seq_ids), per event loop (loop, indices, their queues, request ids, seq_ids). None as
    indices: the whole column."""

    seq_ids: list[int]
    servers: list[tuple[int, list[int] | None, list[int], list[int]]]
    loops: list[tuple[asyncio.AbstractEventLoop, list[int] | None, list[asyncio.Queue], list[str], list[int]]]


class _ServerStep:
    """One server's outputs of a step, gathered straight into the columns of its frame, and the
    sequences they are of, in the frame's order (aborted if the server cannot take them)."""

    __slots__ = ("frame", "seq_ids")

    def __init__(self) -> None:
        self.frame = StreamOutputs([], [], [])
        self.seq_ids: list[int] = []


def _put_all(handed: list[_Handed]) -> None:
    """On the loop: each output onto its stream's queue, in the order handed."""
    for _, queue, fields in handed:
        queue.put_nowait(RequestOutput(*fields))


def _put_columns(columns: list[tuple[list[asyncio.Queue], list[str], list[int], list[int]]]) -> None:
    """On the loop: one new token onto each stream's queue, column by column ((queues, request ids,
    tokens, seq_ids), in the order handed)."""
    for queues, request_ids, tokens, _ in columns:
        for queue, request_id, token in zip(queues, request_ids, tokens, strict=True):
            queue.put_nowait(RequestOutput(request_id, [token]))


def _pick(values: list[int], indices: list[int] | None) -> list[int]:
    return values if indices is None else list(map(values.__getitem__, indices))


class Streams:
    """seq_id -> the stream of its request (control thread only); `traces` hears of every end."""

    def __init__(self, scheduler: Scheduler, traces: RequestTraces | None = None,
                 servers: ServerOutputs | None = None):
        self.scheduler = scheduler
        self.traces = traces
        self.servers = servers  # where RemoteStreams' outputs go (serve --api-server-count)
        self._streams: dict[int, Stream | RemoteStream] = {}
        self._routes: dict[int, _Route] = {}  # rank -> where its last column's outputs went

    def add(self, seq_id: int, stream: Stream | RemoteStream) -> None:
        self._streams[seq_id] = stream

    def drop(self, seq_id: int) -> None:
        self._streams.pop(seq_id, None)

    def deliver_step(self, tokens: Iterable[StepTokens],
                     columns: Iterable[tuple[int, list[int], list[int]]] = ()) -> None:
        """Hand one step's tokens to their requests' event loops, one hand-over per loop; a stream
        whose loop is gone aborts its request. `columns`: (rank, seq_ids, one new token of each) of
        sequences that go on (`Scheduler.commit`'s columns), delivered column by column: where each
        one's output goes is looked up once for as long as the rank's column stays the same, not at
        every step."""
        self._deliver(tokens, None, columns)

    def end_with_error(self, seq_id: int, error: str) -> None:
        """Abort the sequence and finish its stream with `error`, handed over at once."""
        if seq_id in self.scheduler.by_id:
            self.scheduler.abort(seq_id)
            self._deliver([(seq_id, [], "error", None)], error)

    def end_all(self, error: str) -> None:
        """Finish every stream with `error` (the server shutting down)."""
        self._deliver([(seq_id, [], "error", None) for seq_id in self._streams], error)

    def _deliver(self, tokens: Iterable[StepTokens], error: str | None,
                 columns: Iterable[tuple[int, list[int], list[int]]] = ()) -> None:
        """`tokens` onto their streams, each output with `error` (None: a step's tokens), and the
        `columns` (`deliver_step`)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Handed]] = {}
        by_server: dict[int, _ServerStep] = {}
        by_loop_columns = self._gather_columns(columns, by_server)
        streams = self._streams
        for seq_id, new_token_ids, finish_reason, logprobs in tokens:
            stream = streams.get(seq_id)
            if stream is None:
                continue
            finished = finish_reason is not None
            if finished:
                self._ended(seq_id, finish_reason)
            if type(stream) is RemoteStream:  # into its server's frame, column by column
                step = by_server.get(stream.server)
                if step is None:
                    step = by_server[stream.server] = _ServerStep()
                frame, i = step.frame, len(step.seq_ids)
                step.seq_ids.append(seq_id)
                frame.keys.append(stream.key)
                frame.counts.append(len(new_token_ids))
                frame.token_ids.extend(new_token_ids)
                if finished:
                    frame.finished.append((i, finish_reason))
                if error is not None:
                    frame.errors.append((i, error))
                if logprobs is not None:
                    frame.logprobs.append((i, logprobs))
                continue
            handed = by_loop.get(stream.loop)
            if handed is None:
                handed = by_loop[stream.loop] = []
            handed.append((seq_id, stream.queue,
                           (stream.request_id, new_token_ids, finished, finish_reason, error, logprobs)))
        self._hand_over(by_loop)
        self._hand_over_columns(by_loop_columns)
        if by_server:
            self._send_to_servers(by_server)

    def _gather_columns(self, columns: Iterable[tuple[int, list[int], list[int]]], by_server: dict[int, _ServerStep]
                        ) -> dict[asyncio.AbstractEventLoop, list[tuple[list, list[str], list[int], list[int]]]]:
        """The columns' outputs into their servers' frames (`by_server`), and per event loop what it
        is handed (`_put_columns`)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[list, list[str], list[int], list[int]]]] = {}
        for rank, seq_ids, tokens in columns:
            route = self._routes.get(rank)
            if route is None or route.seq_ids != seq_ids:
                route = self._routes[rank] = self._route(seq_ids)
            for server, indices, keys, ids in route.servers:
                step = by_server.get(server)
                if step is None:
                    step = by_server[server] = _ServerStep()
                frame = step.frame
                step.seq_ids.extend(ids)
                frame.keys.extend(keys)
                frame.counts.extend([1] * len(keys))
                frame.token_ids.extend(_pick(tokens, indices))
            for loop, indices, queues, request_ids, ids in route.loops:
                by_loop.setdefault(loop, []).append((queues, request_ids, _pick(tokens, indices), ids))
        return by_loop

    def _route(self, seq_ids: list[int]) -> _Route:
        """Where the outputs of `seq_ids` go, each stream of theirs as it is now (a sequence without
        one is left out, as `_deliver` skips it)."""
        servers: dict[int, tuple[list[int], list[int], list[int]]] = {}
        loops: dict[asyncio.AbstractEventLoop, tuple[list[int], list[asyncio.Queue], list[str], list[int]]] = {}
        for i, seq_id in enumerate(seq_ids):
            stream = self._streams.get(seq_id)
            if stream is None:
                continue
            if type(stream) is RemoteStream:
                indices, keys, ids = servers.setdefault(stream.server, ([], [], []))
                keys.append(stream.key)
            else:
                indices, queues, request_ids, ids = loops.setdefault(stream.loop, ([], [], [], []))
                queues.append(stream.queue)
                request_ids.append(stream.request_id)
            indices.append(i)
            ids.append(seq_id)
        n = len(seq_ids)

        def whole(indices: list[int]) -> list[int] | None:
            return None if len(indices) == n else indices

        return _Route(list(seq_ids), [(server, whole(i), keys, ids) for server, (i, keys, ids) in servers.items()],
                      [(loop, whole(i), queues, rids, ids) for loop, (i, queues, rids, ids) in loops.items()])

    def _hand_over_columns(self, by_loop: dict[asyncio.AbstractEventLoop, list[tuple]]) -> None:
        """Each loop's columns in one hand-over; the sequences of a closed loop are aborted."""
        for loop, columns in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_columns, columns)
            except RuntimeError:  # the loop is closed: nobody reads these streams any more
                for _, _, _, ids in columns:
                    for seq_id in ids:
                        self.scheduler.abort(seq_id)
                        self._ended(seq_id, "abort")

    def _ended(self, seq_id: int, finish_reason: str) -> None:
        del self._streams[seq_id]
        if self.traces is not None:
            self.traces.finished(seq_id, finish_reason)

    def _hand_over(self, by_loop: dict[asyncio.AbstractEventLoop, list[_Handed]]) -> None:
        for loop, handed in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, handed)
            except RuntimeError:  # the loop is closed: nobody reads these streams any more
                for seq_id, _, (_, _, finished, _, _, _) in handed:
                    self.scheduler.abort(seq_id)
                    if not finished:
                        self._ended(seq_id, "abort")

    def _send_to_servers(self, by_server: dict[int, _ServerStep]) -> None:
        """Each server's outputs in one frame; the requests of a server that cannot take them
        (its process gone) are aborted, as those of a closed loop are."""
        for server, step in by_server.items():
            if self.servers is not None and self.servers.send(server, step.frame):
                continue
            ended = {i for i, _ in step.frame.finished}
            for i, seq_id in enumerate(step.seq_ids):
                self.scheduler.abort(seq_id)
                if i not in ended:
                    self._ended(seq_id, "abort")
