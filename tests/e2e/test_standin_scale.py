"""A real `elastic-ep serve` controller with 192 stand-in ranks (harness/standin.py: 24 nodes in 3
processes, the real wire protocol, no model; a DeepSeek-V3-shaped config with tiny tensors): while
it streams completions, one rank is killed and another stopped (SIGSTOP) through /chaos; each is
named by the signal that should catch it (the agent's exit report for the kill, the heartbeats or
the watchdog for the stop, only after the stop was sent), the group forms a new epoch without them,
the streams finish, and no other rank is ever named (no false fault at this size); the answers of
two ranks to a step are lost on the way (/chaos/lose) and asked for again, and the streams go on in
the same epoch, with no fault; all of it with each rank sending its own step results and getting
its own plans, and with each node's agent gathering its ranks' results and relaying their plans
(--step-results-via agent --step-plans-via agent). How fast each is found is the benchmark's to say
(benchmarks/control_plane.py), not this test's: on this shared 2-core machine a stand-in process can
wait seconds for a core. The deadlines leave room for that wait (--heartbeat-timeout-s 2,
--agent-timeout-s 5, --watchdog-floor-s 5: with the watchdog's 1 s floor, the ranks of a stand-in
process that waited over a second for a core were all named hung at once), so that a starved
stand-in process is less often a false fault."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.load import StreamingLoad
from elastic_ep.harness.standin import standin_model

from .conftest import Server

pytestmark = [
    # In the suite since heartbeats come per node (one frame per node of 8 every 0.1 s, not 1,920
    # frames a second) and the stand-ins watch their sockets with epoll: 14-15 s a pass here
    # (2026-12-02, three runs), where it took ~67 s and was opt-in (a stand-in process starved
    # for seconds at load average 15-30 had failed three runs three ways).
    pytest.mark.e2e,
]

RANKS, PER_NODE, PROCESSES = 192, 8, 3
HEARTBEAT_TIMEOUT_S = 2.0
AGENT_TIMEOUT_S = 5.0
WATCHDOG_FLOOR_S = 5.0


@pytest.fixture(scope="module", params=["direct", "agent"])
def cluster(request, tmp_path_factory):
    """The server and its stand-ins, whose results and plans go by each rank (direct) or per node through
    its agent (agent)."""
    tmp = tmp_path_factory.mktemp("standin")
    log, key_file = tmp / "serve.log", tmp / "cluster.key"
    model = str(standin_model())  # DeepSeek-V3's 256 experts per layer: room for 192 ranks
    server = Server(["--model", model, "--ep-size", str(RANKS), "--local-ranks", "0", "--enable-chaos",
                     "--cluster-key-file", str(key_file),
                     "--restart-delay-s", "-1", "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
                     "--agent-timeout-s", str(AGENT_TIMEOUT_S), "--watchdog-floor-s", str(WATCHDOG_FLOOR_S),
                     "--startup-timeout-s", "300", "--step-plans-via", request.param], log, ready_timeout_s=None)
    nodes = [f"n{i}" for i in range(RANKS // PER_NODE)]
    procs = []
    try:
        addr = server.controller_addr()
        for p in range(PROCESSES):
            procs.append(subprocess.Popen([
                sys.executable, "-m", "elastic_ep.harness.standin", "--controller", addr,
                "--ranks-per-node", str(PER_NODE), "--step-ms", "20", "--jitter-ms", "5", "--model", model,
                "--cluster-key-file", str(key_file), "--step-results-via", request.param,
                "--step-plans-via", request.param,
                *[a for n in nodes[p::PROCESSES] for a in ("--node", n)]]))
        server.wait_ready(300)  # the stand-in processes import torch first: slow on a busy machine
        server.wait_full_group(RANKS, 60)
        yield server
    finally:
        server.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def events(server: Server, kind: str) -> list[dict]:
    for attempt in range(3):  # a keep-alive connection the server closed as it was reused
        try:
            answer = server.http.get("/cluster", params={"events": 0})
            break
        except httpx.TransportError:
            if attempt == 2:
                raise
    return [e for e in answer.json()["events"] if e["kind"] == kind]


def faults(server: Server) -> list[dict]:
    return events(server, "fault")


def signal_sent(server: Server, name: str, rank_id: int) -> dict:
    """The chaos event of the signal the controller had the rank's agent deliver."""
    return next(e for e in events(server, "chaos") if e["rank_id"] == rank_id and e["message"].startswith(name))


def named_within(server: Server, rank_id: int, since_s: float, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in faults(server) if e["rank_id"] == rank_id]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"rank {rank_id} was not named within {timeout_s}s")


def test_kill_and_stop_among_192_standins(cluster, request):
    server = cluster
    load = StreamingLoad(server.url, threads=4, max_tokens=24)
    load.start()
    try:
        time.sleep(1.0)
        killed, stopped = 37, 150
        t0 = time.time()
        assert server.http.post("/chaos/kill", json={"rank_id": killed}).status_code == 200
        kill = named_within(server, killed, t0, 30)
        assert kill["signal"] == "exited"  # its agent's exit report, not its silence
        assert kill["time_s"] >= signal_sent(server, "SIGKILL", killed)["time_s"]
        server.wait_for(lambda c: killed not in c["members"] and c["ready"], 60, "an epoch without the killed rank")
        t0 = time.time()
        assert server.http.post("/chaos/hang", json={"rank_id": stopped}).status_code == 200
        stop = named_within(server, stopped, t0, 60)
        assert stop["signal"] in ("heartbeat", "hung")  # a stopped process says nothing: its silence names it
        assert stop["time_s"] >= signal_sent(server, "SIGSTOP", stopped)["time_s"]
        after = server.wait_for(lambda c: stopped not in c["members"] and c["ready"], 60,
                                "an epoch without the stopped rank")
        assert len(after["members"]) == RANKS - 2
        time.sleep(2.0)
    finally:
        load.stop()
    assert load.done > 0 and not load.failures, load.failures[:3]
    assert sorted(e["rank_id"] for e in faults(server)) == [killed, stopped]
    plans_out = server.cluster()["control_times"]["plans_out"]  # the plans went the mode's way, before and after
    assert (plans_out["relayed"] > plans_out["direct"]) == (request.node.callspec.params["cluster"] == "agent")


def lost_results(server: Server, outcome: str) -> float:
    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return sum(s.value for f in families if f.name == "elastic_ep_lost_step_results" for s in f.samples
               if s.name.endswith("_total") and s.labels["outcome"] == outcome)


def test_lost_step_answers_are_asked_for_again_among_the_standins(cluster):
    server = cluster
    # the module's cluster: an earlier test's recovery leaves a background rebalance, whose epochs are not this test's
    before = server.wait_for(lambda c: not c["rebalance"]["active"], 60, "no background rebalance under way")
    lose = [before["members"][5], before["members"][-3]]
    resent = lost_results(server, "resent")
    load = StreamingLoad(server.url, threads=4, max_tokens=24)
    load.start()
    try:
        time.sleep(1.0)
        t0 = time.time()
        for rank_id in lose:
            assert server.http.post("/chaos/lose", json={"rank_id": rank_id}).status_code == 200
        deadline = time.monotonic() + 60
        while not set(lose) <= {r for e in events(server, "resend") if e["time_s"] > t0 for r in e["ranks"]}:
            assert time.monotonic() < deadline, "the lost answers were not asked for again within 60 s"
            time.sleep(0.1)
        time.sleep(1.0)
    finally:
        load.stop()
    assert load.done > 0 and not load.failures, load.failures[:3]
    after = server.cluster()
    assert after["epoch"] == before["epoch"] and after["members"] == before["members"]  # no recovery
    assert lost_results(server, "resent") >= resent + len(lose)
    assert not [e for e in faults(server) if e["time_s"] > t0]
