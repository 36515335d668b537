"""The controller's app behind API server processes (`serve --api-server-count N`): it judges
the loopback rule by the client the forwarding server names, not by the server's own
connection, and names the route that answered for the server's request metrics. Over the
scripted engine with Starlette's test client (whose client is not on loopback)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from scripted_engine import ScriptedEngine, byte_tokenizer
from starlette.testclient import TestClient

from elastic_ep.serve.app import create_app, create_engine_app
from elastic_ep.serve.prefix_keys import PrefixKeys
from elastic_ep.serve.proxy import CLIENT_HEADER, ROUTE_HEADER


def engine_app(tmp_path) -> TestClient:
    tokenizer = byte_tokenizer()
    app = create_engine_app(ScriptedEngine(tokenizer), tokenizer, registry=CollectorRegistry(),
                            prefix_keys=PrefixKeys(), metrics_dir=tmp_path, enable_chaos=True)
    return TestClient(app)


def test_operating_routes_judge_the_forwarded_client(tmp_path):
    client = engine_app(tmp_path)
    kill = {"rank_id": 1}
    assert client.post("/chaos/kill", json=kill).status_code == 403  # the test client: not loopback
    assert client.post("/chaos/kill", json=kill, headers={CLIENT_HEADER: "10.0.0.7"}).status_code == 403
    assert client.post("/chaos/kill", json=kill, headers={CLIENT_HEADER: "127.0.0.1"}).status_code == 200


def test_each_answer_names_its_route(tmp_path):
    client = engine_app(tmp_path)
    assert client.get("/cluster").headers[ROUTE_HEADER] == "/cluster"
    assert client.get("/health").headers[ROUTE_HEADER] == "/health"
    assert ROUTE_HEADER not in client.get("/no/such/route").headers  # counted as "other"


def test_its_schema_is_the_whole_apis(tmp_path):
    """The servers forward /openapi.json here: the document names their routes too, as one
    process's would."""
    tokenizer = byte_tokenizer()
    alone = create_app(ScriptedEngine(tokenizer), tokenizer, registry=CollectorRegistry(), enable_chaos=True)
    behind = engine_app(tmp_path).get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/cluster", "/chaos/{action}"} <= set(behind["paths"])
    assert behind["paths"] == alone.openapi()["paths"]
