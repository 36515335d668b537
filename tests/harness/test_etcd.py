"""The test etcd: when a port it was given is taken before it binds it (another process's free
port), it starts again on new ports instead of failing the test that needed it."""

from __future__ import annotations

import socket

import httpx
import pytest

from elastic_ep.harness import etcd as etcd_harness
from elastic_ep.harness.etcd import EtcdProcess, etcd_available


def test_a_taken_client_port_is_replaced_by_a_free_one(monkeypatch):
    if not etcd_available():
        pytest.fail("etcd is not installed: run scripts/install-netbed-deps.sh (Debian's etcd-server)")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    given = iter([port])
    real = etcd_harness.free_port
    monkeypatch.setattr(etcd_harness, "free_port", lambda host: next(given, None) or real(host))
    proc = EtcdProcess()
    try:
        assert not proc.url.endswith(f":{port}")
        assert httpx.get(f"{proc.url}/health", timeout=5).json()["health"] == "true"
    finally:
        proc.stop()
        taken.close()
