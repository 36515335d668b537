"""The engine of an API server process (`serve --api-server-count N`): requests go to the
controller's process over ZeroMQ (wire/api_server.py), their outputs come back one frame a step.

It implements the part of `control.api.Engine` the OpenAI routes use (`info`, `generate`); every
other route of an API server is proxied to the controller's own app (serve/proxy.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from elastic_ep.control.api import EngineInfo, GenerationRequest, RequestOutput, ServiceUnavailable
from elastic_ep.errors import ElasticEPError
from elastic_ep.serve.prefix_keys import is_prefix_key
from elastic_ep.wire import ClusterKey, Inbox, rejected_counts
from elastic_ep.wire.api_server import (
    TO_API_SERVER,
    Abort,
    Admitted,
    Generate,
    PrefixKeySeen,
    ServerReport,
    StreamOutputs,
    api_address,
    tokens_address,
)
from elastic_ep.wire.codec import reject_invalid

logger = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0


class RemoteEngine:
    """API server `server`'s engine: `generate` as `EngineFacade.generate`, over the sockets of
    `workdir`. The sockets and their readers start with the first request, on its loop."""

    def __init__(self, info: EngineInfo, server: int, key: ClusterKey, workdir: Path):
        self.info = info
        self.server = server
        self.key = key
        self.workdir = workdir
        self._keys = itertools.count()
        self._answers: dict[int, asyncio.Future] = {}  # key -> Admitted or Refused, until it comes
        self._streams: dict[int, tuple[str, asyncio.Queue]] = {}  # key -> (request id, its outputs)
        self._abandoned: set[int] = set()  # keys whose client left before the answer came
        self._dealer: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Connect and start the readers, on the running loop (once)."""
        if self._dealer is not None:
            return
        ctx = zmq.asyncio.Context.instance()
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(api_address(self.workdir))
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(tokens_address(self.workdir, self.server))
        self._tasks = [asyncio.ensure_future(self._read_answers(Inbox("api_answers", TO_API_SERVER, self.key))),
                       asyncio.ensure_future(self._read_outputs(pull, Inbox("api_tokens", StreamOutputs, self.key))),
                       asyncio.ensure_future(self._report())]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.start()
        key = next(self._keys)
        queue: asyncio.Queue = asyncio.Queue()
        answer = self._answers[key] = asyncio.get_running_loop().create_future()
        self._streams[key] = (request.request_id, queue)
        seq_id, finished = None, False
        try:
            self._send(Generate(self.server, key, request.request_id, request.prompt_token_ids, request.params,
                                request.seed, list(request.resumed_output_token_ids)))
            msg = await answer
            if not isinstance(msg, Admitted):
                if msg.status == 503:
                    raise ServiceUnavailable(msg.message, msg.retry_after_s)
                raise ElasticEPError(msg.message)
            seq_id = msg.seq_id
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(key, None)
            if self._answers.pop(key, None) is not None and not answer.done():
                self._abandoned.add(key)  # admitted later: aborted when the answer comes
            elif seq_id is not None and not finished:
                self._send(Abort(seq_id))

    def record(self, key: str | None) -> None:
        """A prefix key a router named (serve/prefix_keys.py): counted by the controller's app."""
        if is_prefix_key(key):
            self.start()
            self._send(PrefixKeySeen(key))

    def _send(self, msg: Generate | Abort | PrefixKeySeen | ServerReport) -> None:
        self._dealer.send_multipart(self.key.seal(msg))  # a DEALER on ipc queues it at once

    async def _read_answers(self, inbox: Inbox) -> None:
        while True:
            msg = inbox.read(await self._dealer.recv_multipart(copy=False))
            if msg is None:
                continue
            answer = self._answers.pop(msg.key, None)
            if answer is not None and not answer.done():
                answer.set_result(msg)
            elif msg.key in self._abandoned:
                self._abandoned.discard(msg.key)
                if isinstance(msg, Admitted):
                    self._send(Abort(msg.seq_id))

    async def _read_outputs(self, pull: zmq.asyncio.Socket, inbox: Inbox) -> None:
        while True:
            frames = await pull.recv_multipart(copy=False)
            msg = inbox.read(frames)
            if msg is None:
                continue
            problem = msg.check()
            if problem is not None:
                reject_invalid("api_tokens", "", "controller", problem)
                continue
            finished, errors, logprobs = dict(msg.finished), dict(msg.errors), dict(msg.logprobs)
            start = 0
            for i, (key, count) in enumerate(zip(msg.keys, msg.counts, strict=True)):
                tokens = msg.token_ids[start:start + count]
                start += count
                stream = self._streams.get(key)
                if stream is None:
                    continue
                reason = finished.get(i)
                stream[1].put_nowait(RequestOutput(stream[0], tokens, reason is not None, reason, errors.get(i),
                                                   logprobs.get(i)))

    async def _report(self) -> None:
        """The frames this process dropped, to the controller's metrics, every REPORT_INTERVAL_S."""
        while True:
            counts = [(socket, reason, n) for (socket, _, reason), n in sorted(rejected_counts().items())]
            self._send(ServerReport(self.server, counts))
            await asyncio.sleep(REPORT_INTERVAL_S)
