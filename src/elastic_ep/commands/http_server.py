"""The HTTP server of `serve` (alone or in a controller group): uvicorn on the socket bound at start."""

from __future__ import annotations

import signal
import socket

import uvicorn
from starlette.types import ASGIApp

from elastic_ep.serve.guard import request_timeout_protocol

# How long an idle keep-alive connection stays open. Longer than the clients' own expiry (httpx and
# the OpenAI SDK on it, and the router's pool: 5 s, uvicorn's default too): when both sides give up at
# the same moment, the client's next request on a connection the server is closing is reset.
KEEP_ALIVE_S = 75


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run_http(app: ASGIApp, sock: socket.socket, request_timeout_s: float) -> None:
    """Serve `app` on `sock` until SIGINT or SIGTERM. uvicorn shuts down on either, then re-raises
    the signal under the handler found at start: SIGTERM is made an exception here too, so the
    caller's cleanup always runs."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        config = uvicorn.Config(app, log_level="warning", log_config=None, timeout_graceful_shutdown=2,
                                timeout_keep_alive=KEEP_ALIVE_S, http=request_timeout_protocol(request_timeout_s))
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
