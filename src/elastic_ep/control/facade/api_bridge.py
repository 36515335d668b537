"""The controller's side of the API server processes (`serve --api-server-count N`, N > 1).

`ApiBridge` (a thread with its own event loop) reads the servers' `Generate` and `Abort` on the
API socket, admits each request as the in-process facade does (`EngineFacade.admit`: the same
checks, the same wait for a ready cluster) and hands it to the control thread with a
`RemoteStream`; it answers `Admitted` or `Refused`, and takes each server's count of the frames
it dropped into `elastic_ep_control_frames_rejected_total` (node `api-server-K`). `ServerSockets`
is the control thread's side: a step's outputs of one server's requests leave in one
`StreamOutputs` frame on that server's token socket (wire/api_server.py), so the tokens of those
requests never wake an event loop of the controller's process: the servers build the outputs,
detokenize and stream them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio

from elastic_ep.errors import ElasticEPError
from elastic_ep.wire import ClusterKey, Inbox
from elastic_ep.wire.api_server import (
    TO_CONTROLLER,
    Abort,
    Admitted,
    Generate,
    PrefixKeySeen,
    Refused,
    ServerReport,
    StreamOutputs,
    api_address,
    tokens_address,
)

from ..api import GenerationRequest, ServiceUnavailable
from ..metrics import RejectedFrames
from ..serving.streams import RemoteStream
from .engine import EngineFacade
from .to_loop import AbortRequest, AddRequest

logger = logging.getLogger(__name__)

# A server's token socket holds this many steps it has not read yet; past it the server is taken
# as gone (its requests are aborted), never the control thread blocked behind it.
TOKEN_HWM = 10_000


class ServerSockets:
    """The control thread's sockets to the API servers' token sockets, made on first use (on
    that thread, as ZeroMQ wants)."""

    def __init__(self, ctx: zmq.Context, key: ClusterKey, workdir: Path, count: int):
        self.ctx, self.key, self.workdir, self.count = ctx, key, workdir, count
        self._sockets: dict[int, zmq.Socket] = {}

    def send(self, server: int, outputs: StreamOutputs) -> bool:
        sock = self._socket(server)
        if sock is None:
            return False
        try:
            sock.send_multipart(self.key.seal(outputs), zmq.NOBLOCK)
        except zmq.Again:
            logger.error("API server %d has not read %d steps of outputs: taking it as gone", server, TOKEN_HWM)
            return False
        return True

    def _socket(self, server: int) -> zmq.Socket | None:
        if not 0 <= server < self.count:
            return None
        sock = self._sockets.get(server)
        if sock is None:
            sock = self._sockets[server] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, TOKEN_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(tokens_address(self.workdir, server))
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)


class ApiBridge:
    """Admits the API servers' requests into `facade`'s engine: `start()` binds the API socket
    and runs the bridge's thread until `stop()`."""

    def __init__(self, facade: EngineFacade, key: ClusterKey, workdir: Path, rejected: RejectedFrames,
                 record_prefix_key: Callable[[str], None]):
        self.facade = facade
        self.rejected = rejected
        self.record_prefix_key = record_prefix_key  # the keys GET /prefix_keys of the controller's app lists
        self.key = key
        self.workdir = workdir
        self._inbox = Inbox("api_servers", TO_CONTROLLER, key)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="api-bridge", daemon=True)
        self._stopping: asyncio.Event | None = None
        self._admitting: set[asyncio.Task] = set()

    def start(self) -> None:
        self._sock.bind(api_address(self.workdir))
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive() and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        reader = asyncio.ensure_future(self._read())
        await self._stopping.wait()
        tasks = (reader, *self._admitting)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            msg = self._inbox.read(frames[1:])  # after the ROUTER's identity frame
            if isinstance(msg, Generate):
                task = asyncio.ensure_future(self._admit(frames[0].bytes, msg))
                self._admitting.add(task)
                task.add_done_callback(self._admitting.discard)
            elif isinstance(msg, Abort):
                self.facade.send(AbortRequest(msg.seq_id))
            elif isinstance(msg, PrefixKeySeen):
                self.record_prefix_key(msg.key)
            elif isinstance(msg, ServerReport):
                self.rejected.report(f"api-server-{msg.server}", msg.rejected)

    async def _admit(self, identity: bytes, msg: Generate) -> None:
        request = GenerationRequest(msg.request_id, msg.prompt_token_ids, msg.params, msg.seed,
                                    tuple(msg.resumed_output_token_ids))
        try:
            msg.params.validate()
            seq = await self.facade.admit(request)
        except ServiceUnavailable as e:
            await self._answer(identity, Refused(msg.key, 503, str(e), e.retry_after_s))
            return
        except (ElasticEPError, ValueError) as e:
            await self._answer(identity, Refused(msg.key, 400, str(e)))
            return
        self.facade.send(AddRequest(seq, RemoteStream(msg.request_id, msg.server, msg.key)))
        await self._answer(identity, Admitted(msg.key, seq.seq_id))

    async def _answer(self, identity: bytes, msg: Admitted | Refused) -> None:
        await self._sock.send_multipart([identity, *self.key.seal(msg)])
