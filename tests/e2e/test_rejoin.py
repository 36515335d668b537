"""Rejoin across nodes: an agent started with --auto-recover restarts its own dead rank (with
backoff, the controller's restarts off); when its whole node goes, a replacement agent started
with --join-mode recover takes the down ranks over, loading the dense weights from the other
node's agent (a live peer), not from disk. Streaming load runs throughout: no request fails and
every output equals the fault-free run. Last, a scale-up that cannot finish within
--elastic-ep-scale-timeout fails, and the service goes on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from .conftest import Server, reference_load

MODEL = "tiny-deepseek-v3"


def start_agent(server: Server, node: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--controller", server.controller_addr(),
                             "--node", node, "--ranks", "2", "--cluster-key-file", str(server.key_file), *args])


def registered(cluster: dict, rank_id: int) -> list[dict]:
    return [e for e in cluster["events"] if e["kind"] == "registered" and e["rank_id"] == rank_id]


def test_auto_recover_then_a_replacement_node_takes_over(tmp_path):
    # --elastic-ep-scale-timeout 0.05: a joiner forked from its node's zygote joins within half a second here.
    # No readiness gate: each of the ~10 epochs would run its warm-up forwards first (the gate is
    # proven in test_cold_start.py and test_serve.py); the rank's own warm-up forward still runs
    server = Server(["--model", MODEL, "--ep-size", "4", "--local-ranks", "2", "--redundant-experts", "16",
                     "--restart-delay-s", "-1", "--elastic-ep-scale-timeout", "0.05", "--no-warmup-gate"],
                    tmp_path / "serve.log", ready_timeout_s=None)
    agents = [start_agent(server, "node1", "--auto-recover", "--restart-backoff-s", "0.2")]
    try:
        server.wait_ready()
        server.wait_for(lambda c: sum(e["kind"] == "backup" for e in c["events"]) == 2, what="2 backups")
        with reference_load(server, MODEL, threads=2) as load:
            first_pid = server.pids()[3]
            os.kill(first_pid, signal.SIGKILL)
            cluster = server.wait_for(lambda c: len(registered(c, 3)) == 2 and c["ready"]
                                      and len(c["members"]) == 4, what="rank 3 restarted by its agent")
            again = registered(cluster, 3)[-1]
            assert "(recover)" in again["message"] and again["dense_source"] == "host_memory"
            assert again["warmup_s"] > 0  # a dummy forward ran before it registered

            agents[0].send_signal(signal.SIGTERM)  # node1 goes away with ranks 2 and 3
            assert agents[0].wait(20) == 0
            server.wait_for(lambda c: c["ready"] and c["members"] == [0, 1], what="serving on node0 alone")
            agents.append(start_agent(server, "node2", "--join-mode", "recover"))
            cluster = server.wait_full_group(4)
            assert {r["rank_id"]: r["node"] for r in cluster["ranks"]} == {0: "node0", 1: "node0", 2: "node2",
                                                                          3: "node2"}
            assert all(registered(cluster, r)[-1]["dense_source"] == "peer" for r in (2, 3))

            assert server.http.post("/scale_elastic_ep", json={"new_ep_size": 5}).status_code == 200
            status = server.wait_for(lambda c: c["scale"]["scale_phase"] == "failed", what="the scale to time out")
            assert "--elastic-ep-scale-timeout 0.05s" in status["scale"]["last_error"]
            server.wait_for(lambda c: sorted(r["rank_id"] for r in c["ranks"]) == [0, 1, 2, 3], what="rank 4 gone")
        assert not load.failures, load.failures[:3]
        assert load.done > 0
    finally:
        server.stop()
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
            agent.wait(20)
