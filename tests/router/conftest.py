"""Routers in front of in-process `serve` apps over the scripted engine (tests/serve), every
server a real uvicorn on a free loopback port."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).parent.parent / "serve"))

from scripted_engine import ScriptedEngine, ServerThread, byte_tokenizer  # noqa: E402

from elastic_ep.router.app import create_app as create_router_app  # noqa: E402
from elastic_ep.router.config import RouterConfig  # noqa: E402
from elastic_ep.serve.app import create_app as create_serve_app  # noqa: E402


class Instance:
    """One serve app over its own scripted engine."""

    def __init__(self):
        tokenizer = byte_tokenizer()
        self.engine = ScriptedEngine(tokenizer)
        self.server = ServerThread(create_serve_app(self.engine, tokenizer, registry=CollectorRegistry()))
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()


class RouterThread:
    """The router app on uvicorn (with its lifespan: the poll loop) in a daemon thread."""

    def __init__(self, cfg: RouterConfig, startup_timeout_s: float = 10.0):
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.app = create_router_app(cfg)
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline_s = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline_s or not self._thread.is_alive():
                raise RuntimeError(f"router did not start within {startup_timeout_s} s")
            time.sleep(0.01)

    @property
    def core(self):
        return self.app.state.router

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()


@pytest.fixture
def instances():
    """instances(k) -> k fresh serve instances, stopped when the test ends."""
    started: list[Instance] = []

    def make(k: int) -> list[Instance]:
        new = [Instance() for _ in range(k)]
        started.extend(new)
        return new

    yield make
    for instance in started:
        instance.stop()


@pytest.fixture
def routers():
    """routers(cfg) -> a running router, stopped when the test ends."""
    started: list[RouterThread] = []

    def make(cfg: RouterConfig) -> RouterThread:
        router = RouterThread(cfg)
        started.append(router)
        return router

    yield make
    for router in started:
        router.stop()
