"""Fixtures: one real uvicorn server per test module, over the scripted engine."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from scripted_engine import ScriptedEngine, ServerThread, byte_tokenizer

from elastic_ep.serve.app import create_app


class Served:
    def __init__(self, engine: ScriptedEngine, registry: CollectorRegistry, url: str):
        self.engine = engine
        self.registry = registry
        self.url = url


def serve(enable_chaos: bool):
    tokenizer = byte_tokenizer()
    engine = ScriptedEngine(tokenizer)
    registry = CollectorRegistry()
    server = ServerThread(create_app(engine, tokenizer, registry=registry, enable_chaos=enable_chaos))
    try:
        yield Served(engine, registry, server.url)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served():
    yield from serve(enable_chaos=False)


@pytest.fixture(scope="module")
def served_chaos():
    yield from serve(enable_chaos=True)
