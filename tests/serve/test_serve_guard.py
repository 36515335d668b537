"""The HTTP guard as vLLM's: /v1 needs --api-key, operating routes --admin-api-key (or loopback
when there is none), probes stay open; oversized bodies 413; a silent or trickling client is
cut off. Over the scripted engine (real uvicorn; Starlette's test client for a client that is
not on loopback)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from scripted_engine import MODEL, ScriptedEngine, ServerThread, byte_tokenizer
from starlette.testclient import TestClient

from elastic_ep.cli import main
from elastic_ep.serve.app import create_app
from elastic_ep.serve.guard import ADMIN_API_KEY_ENV, HttpGuard, request_timeout_protocol

API, ADMIN = "sk-api-test", "sk-admin-test"
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def app_with(guard: HttpGuard, enable_chaos: bool = True):
    tokenizer = byte_tokenizer()
    return create_app(ScriptedEngine(tokenizer), tokenizer, registry=CollectorRegistry(), enable_chaos=enable_chaos,
                      guard=guard)


@pytest.fixture(scope="module")
def guarded():
    server = ServerThread(app_with(HttpGuard(API, ADMIN, max_request_body_bytes=4096)))
    yield server.url
    server.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_v1_needs_the_api_key(guarded):
    for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {API}"}):
        r = httpx.post(f"{guarded}/v1/completions", json=COMPLETION, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{guarded}/v1/models").status_code == 401
    assert httpx.get(f"{guarded}/v1/models", headers=bearer(API)).status_code == 200
    assert httpx.post(f"{guarded}/v1/completions", json=COMPLETION, headers=bearer(API)).status_code == 200
    assert httpx.get(f"{guarded}/v1/models", headers=bearer(ADMIN)).status_code == 200


def test_operating_routes_need_the_admin_key_and_probes_stay_open(guarded):
    for method, path, body in (("post", "/scale_elastic_ep", {"new_ep_size": 3}),
                               ("post", "/chaos/kill", {"rank_id": 1}),
                               ("post", "/rolling_restart", {}), ("get", "/rolling_restart", None),
                               ("post", "/start_expert_distribution_record", None),
                               ("get", "/dump_expert_distribution_record", None)):
        assert httpx.request(method, f"{guarded}{path}", json=body).status_code == 401
        wrong = httpx.request(method, f"{guarded}{path}", json=body, headers=bearer(API))
        assert wrong.status_code == 403 and wrong.json()["error"]["type"] == "permission_error"
        assert httpx.request(method, f"{guarded}{path}", json=body, headers=bearer(ADMIN)).status_code < 400
    for path in ("/health", "/ready", "/metrics", "/cluster", "/is_scaling_elastic_ep", "/openapi.json"):
        assert httpx.get(f"{guarded}{path}").status_code == 200, path


def test_without_an_admin_key_operating_routes_answer_loopback_only():
    app = app_with(HttpGuard())
    remote, local = TestClient(app, client=("203.0.113.7", 4000)), TestClient(app, client=("127.0.0.1", 4000))
    r = remote.post("/chaos/kill", json={"rank_id": 1})
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
    assert remote.post("/scale_elastic_ep", json={"new_ep_size": 3}).status_code == 403
    assert local.post("/scale_elastic_ep", json={"new_ep_size": 3}).status_code == 200
    assert remote.post("/v1/completions", json=COMPLETION).status_code == 200  # no --api-key: /v1 is open
    assert remote.get("/metrics").status_code == 200


def test_an_oversized_or_unsized_body_is_refused_before_it_is_read(guarded):
    big = {**COMPLETION, "prompt": "x" * 5000}
    r = httpx.post(f"{guarded}/v1/completions", json=big, headers=bearer(API))
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]

    def chunks():
        yield b'{"model": "scripted", '
        yield b'"prompt": "hi"}'
    r = httpx.post(f"{guarded}/v1/completions", content=chunks(), headers=bearer(API))
    assert r.status_code == 411
    assert httpx.post(f"{guarded}/v1/completions", json=COMPLETION, headers=bearer(API)).status_code == 200


def test_the_openapi_document_lists_the_guard(guarded):
    spec = httpx.get(f"{guarded}/openapi.json").json()
    assert set(spec["components"]["securitySchemes"]) == {"apiKey", "adminKey"}
    completions = spec["paths"]["/v1/completions"]["post"]
    assert {"401", "411", "413"} <= set(completions["responses"]) and {"apiKey": []} in completions["security"]
    chaos = spec["paths"]["/chaos/{action}"]["post"]
    assert {"401", "403", "413"} <= set(chaos["responses"]) and {"adminKey": []} in chaos["security"]
    assert "security" not in spec["paths"]["/health"]["get"]


def test_a_client_that_sends_nothing_or_trickles_is_cut_off():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(app_with(HttpGuard()), log_level="warning", lifespan="off",
                            http=request_timeout_protocol(1.0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        silent = socket.create_connection(sock.getsockname())
        trickle = socket.create_connection(sock.getsockname())
        t0 = time.monotonic()
        for part in (b"GET /hea", b"lth HTTP/1.1\r\n", b"Host: x\r\n"):  # never the blank line
            trickle.sendall(part)
            time.sleep(0.3)
        silent.settimeout(10)
        trickle.settimeout(10)
        assert silent.recv(1) == b"" and trickle.recv(1) == b""  # closed by the server
        assert time.monotonic() - t0 < 5
        assert httpx.get(f"{url}/health").status_code == 200  # a whole request in time is served
        with httpx.Client() as keep:  # and a keep-alive connection serves requests after the timeout
            assert keep.get(f"{url}/health").status_code == 200
            time.sleep(0.5)
            assert keep.get(f"{url}/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_the_chaos_cli_sends_the_admin_key(guarded, capsys, monkeypatch):
    assert main(["chaos", guarded, "kill", "1"]) == 2
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["chaos", guarded, "kill", "1", "--admin-api-key", ADMIN]) == 0
    monkeypatch.setenv(ADMIN_API_KEY_ENV, ADMIN)
    assert main(["chaos", guarded, "slow", "1", "--delay-s", "0"]) == 0
