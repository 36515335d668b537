"""The HTTP side of a controller in a group (serve/group_gate.py): a standby answers as a standby,
then the app it leads answers everything, with the group in /health and /cluster."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from scripted_engine import ScriptedEngine, byte_tokenizer
from starlette.testclient import TestClient

from elastic_ep.group.election import ElectionState, Role
from elastic_ep.group.status import group_view, standby_reason
from elastic_ep.group.store import Seat
from elastic_ep.serve.app import create_app
from elastic_ep.serve.group_gate import GroupGate

LEADER = Seat("c0", "http://10.0.0.1:8000", "tcp://10.0.0.1:5555", "leader", 12)
STATE = ElectionState(Role.STANDBY, 7, LEADER, seats=(LEADER, Seat("c1", "http://10.0.0.2:8000", "", "standby", 9)))


def test_a_standby_is_alive_not_ready_and_sends_clients_to_the_leader():
    gate = GroupGate(lambda: group_view("g", "http://etcd:2379", "c1", STATE), lambda: standby_reason("g", STATE),
                     CollectorRegistry())
    with TestClient(gate) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["role"] == "standby"
        assert "the leader is c0 at http://10.0.0.1:8000 (term 7)" in health.json()["reason"]
        assert client.get("/ready").status_code == 503
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/scale_elastic_ep")):
            r = client.request(method, path, json={})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert r.headers["X-Elastic-EP-Leader"] == LEADER.http and r.json()["error"]["code"] == "standby"
        group = client.get("/cluster").json()["group"]
        assert group["leader"]["name"] == "c0" and group["term"] == 7
        assert {m["name"]: m["lag"] for m in group["members"]} == {"c0": 0, "c1": 3}
        assert client.get("/metrics").status_code == 200


def test_once_it_leads_the_app_answers_with_the_group():
    state = ElectionState(Role.LEADER, 8, LEADER, seats=(LEADER,))
    view = lambda: group_view("g", "http://etcd:2379", "c0", state)  # noqa: E731
    gate = GroupGate(view, lambda: standby_reason("g", state), CollectorRegistry())
    with TestClient(gate) as client:
        assert "its controller is starting" in client.get("/ready").json()["reason"]
        tokenizer = byte_tokenizer()
        gate.lead(create_app(ScriptedEngine(tokenizer), tokenizer, registry=CollectorRegistry(), group=view))
        assert client.get("/health").json()["role"] == "leader"
        cluster = client.get("/cluster").json()
        assert cluster["role"] == "leader" and cluster["group"]["term"] == 8 and "record" not in cluster["group"]
        assert client.get("/v1/models").status_code == 200
