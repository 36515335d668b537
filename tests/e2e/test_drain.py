"""Drain and cordon end to end: a real server with two nodes (node0 inside `elastic-ep serve`,
node1 an `elastic-ep agent` on loopback), streaming requests running the whole time. Draining
rank 1 (not the highest) and then all of node1 fails no request and changes no output; the
drained ranks stop, node1's agent exits 0, and impossible drains are refused naming the problem.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from elastic_ep.harness.server_process import processes_left

from .conftest import Server, reference_load

MODEL = "tiny-deepseek-v3"
# 16 experts + 24 redundant over 5 ranks: 8 slots per rank, so 2 ranks hold every expert. No
# readiness gate: each drain forms epochs that would run their warm-up forwards first (the gate
# is proven in test_cold_start.py and test_serve.py).
SERVE_ARGS = ["--model", MODEL, "--ep-size", "5", "--local-ranks", "3", "--redundant-experts", "24",
              "--restart-delay-s", "0.5", "--scale-drain-timeout-s", "1.0", "--no-warmup-gate"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    server = Server(SERVE_ARGS, tmp_path_factory.mktemp("serve") / "serve.log", ready_timeout_s=None)
    agent = subprocess.Popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--controller", server.controller_addr(),
                              "--node", "node1", "--ranks", "2", "--cluster-key-file", str(server.key_file)])
    try:
        server.wait_ready(120)
        server.wait_full_group(5)
        yield server, agent
    finally:
        server.stop()
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def drain(server, body: dict) -> dict:
    reply = server.http.post("/drain", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_drained(server, ranks: list[int], timeout_s: float = 90.0) -> dict:
    """Until the drain is done and its ranks have left /cluster; returns the cluster."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = server.http.get("/is_scaling_elastic_ep").json()
        if not status["is_scaling_elastic_ep"]:
            assert status["scale_phase"] == "serving_shrunk", status
            cluster = server.wait_for(lambda c: not set(ranks) & {r["rank_id"] for r in c["ranks"]},
                                      what=f"ranks {ranks} gone")
            assert cluster["ready"]
            return cluster
        time.sleep(0.05)
    raise TimeoutError(f"drain of {ranks} not done in {timeout_s}s")


def test_drain_a_middle_rank_then_a_whole_node_under_load(two_nodes):
    server, agent = two_nodes
    before = server.cluster()
    nodes = {r["rank_id"]: r["node"] for r in before["ranks"]}
    assert nodes == {0: "node0", 1: "node0", 2: "node0", 3: "node1", 4: "node1"}
    assert not any(r["safe_to_terminate"] for r in before["ranks"])  # every rank serves
    pids = server.pids()
    with reference_load(server, MODEL, threads=5) as load:
        load.wait_done(3)
        assert drain(server, {"ranks": [1]}) == {"ranks": [1], "node": None, "old_ep_size": 5, "new_ep_size": 4}
        cluster = wait_drained(server, [1])
        assert cluster["members"] == [0, 2, 3, 4] and not processes_left({pids[1]})
        assert any("rank 1 stopped (exited with code 0)" in e["message"] for e in cluster["events"])
        done = load.done
        load.wait_done(done + 3)
        assert drain(server, {"node": "node1"})["ranks"] == [3, 4]
        cluster = wait_drained(server, [3, 4])
        assert cluster["members"] == [0, 2] and cluster["cordoned"] == ["node1"]
        assert agent.wait(30) == 0  # what a preStop hook waits for
        assert not processes_left({pids[3], pids[4]})
        load.wait_done(load.done + 3)
    assert not load.failures, load.failures[:3]
    assert load.done > 0


def test_impossible_drains_are_refused_and_a_cordoned_node_gets_no_new_rank(two_nodes):
    server, _ = two_nodes
    server.wait_for(lambda c: c["members"] == [0, 2] and c["ready"], timeout_s=120, what="the drained group")
    for body, status, needle in [({"node": "node0"}, 400, "fewer than the 2"), ({"ranks": [7]}, 400, "ranks [7]"),
                                 ({"node": "node9"}, 400, "no node 'node9'"), ({"ranks": [0], "node": "node0"}, 400,
                                                                               "not both")]:
        reply = server.http.post("/drain", json=body)
        assert reply.status_code == status and needle in reply.text, (body, reply.text)
    assert server.http.post("/scale_elastic_ep", json={"new_ep_size": 3}).status_code == 200
    busy = server.http.post("/drain", json={"ranks": [2]})
    assert busy.status_code == 409 and "in flight" in busy.text
    cluster = server.wait_full_group(3, timeout_s=90)
    assert {r["node"] for r in cluster["ranks"]} == {"node0"}  # node1 is cordoned (and its agent gone)
    assert server.http.post("/uncordon", json={"node": "node1"}).json() == {"node": "node1", "cordoned": False}
    assert server.cluster()["cordoned"] == []
