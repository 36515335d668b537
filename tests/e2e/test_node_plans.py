"""--step-plans-via agent end to end: 4 real ranks whose step plans come as their node's one
`NodeStepPlans` through the node's agent (and their results go back the same way,
--step-results-via agent). Under concurrent streaming the output equals single-process
`elastic-ep generate` token for token, as direct plans give; a rank killed mid-stream is recovered
with exact output, and the plans go through the agent again in the new epoch; a rank stopped
mid-stream is named, fenced and replaced, the output exact; a node's agent (its own process)
stopped mid-stream loses the plan it holds, which the result deadline finds (its ranks answer
NOT_RUN), and the streams go on exact; a plan lost by chaos (/chaos/lose_plan) goes directly,
after its `ChaosStep` (relayed, it could overtake it), and is found the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.load import streams_with_fault

from .conftest import PROMPTS, Server, reference

MAX_TOKENS = 32
MODEL = "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--model", MODEL, "--ep-size", "4", "--redundant-experts", "4", "--restart-delay-s", "1.0",
                          "--step-plans-via", "agent", "--step-results-via", "agent", "--enable-chaos")


def plans_out(server) -> dict[str, int]:
    return server.cluster()["control_times"]["plans_out"]


def lost_results(server) -> dict[str, float]:
    """outcome -> answers asked for again (`resent`, `not_run`: a plan that never arrived)."""
    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return {s.labels["outcome"]: s.value for f in families if f.name == "elastic_ep_lost_step_results"
            for s in f.samples if s.name.endswith("_total")}


def recovered_from(server, epoch: int, culprit: int) -> None:
    """Waits for a recovery into an epoch after `epoch` that names `culprit`."""
    def named(c: dict) -> bool:
        return any(e["kind"] == "recovered" and e.get("epoch", -1) > epoch and culprit in e["culprits"]
                   for e in c["events"])
    server.wait_for(named, timeout_s=10, what=f"a recovery naming rank {culprit}")


def test_streams_through_the_agent_relay_are_exact_and_no_plan_is_lost(server):
    server.wait_full_group(4)
    before = plans_out(server)
    results = streams_with_fault(server.url, lambda: None, PROMPTS, MAX_TOKENS, temperature=0)
    assert [r.text for r in results] == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    after = plans_out(server)
    # the plans of these steps went in the node's frame through the agent (a rank whose heartbeats
    # lag on this loaded machine gets its plan directly for that step)
    relayed, direct = after["relayed"] - before["relayed"], after["direct"] - before["direct"]
    assert relayed >= 4 * (MAX_TOKENS // 2) and relayed > 4 * direct, after  # ~a step per token, 4 ranks
    assert not any(lost_results(server).values()), lost_results(server)


def _signal_under_load_then_exact(server, rank: int, sig: signal.Signals) -> int:
    """Streams while `rank`'s worker gets `sig`: exact output, the rank named and recovered from.
    Returns the signalled pid."""
    before = server.wait_full_group(4)
    pid = server.pids()[rank]
    results = streams_with_fault(server.url, lambda: os.kill(pid, sig), PROMPTS, MAX_TOKENS, temperature=0)
    assert [r.text for r in results] == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    recovered_from(server, before["epoch"], rank)
    return pid


def test_a_killed_rank_is_recovered_with_exact_output_and_plans_relayed_again(server):
    pid = _signal_under_load_then_exact(server, 1, signal.SIGKILL)
    back = server.wait_full_group(4)
    assert back["ranks"][1]["pid"] != pid
    relayed = plans_out(server)["relayed"]
    results = streams_with_fault(server.url, lambda: None, PROMPTS[:3], MAX_TOKENS, temperature=0)
    assert [r.text for r in results] == list(reference(MODEL, tuple(PROMPTS[:3]), MAX_TOKENS))
    assert plans_out(server)["relayed"] > relayed  # the restarted rank's agent relays its plans too


def test_a_stopped_rank_is_named_fenced_and_replaced_with_exact_output(server):
    """SIGSTOP: the plan relayed to it waits in its socket; its heartbeats (through the agent) stop,
    it is named and fenced, the step is recomputed without it, and the output stays exact."""
    pid = _signal_under_load_then_exact(server, 2, signal.SIGSTOP)
    assert server.wait_full_group(4)["ranks"][2]["pid"] != pid


def test_a_plan_lost_by_chaos_goes_directly_and_is_asked_for_with_exact_output(server):
    """With plans relayed, /chaos/lose_plan's rank gets that step's plan directly, after its
    `ChaosStep` on the same socket: its rank drops it, answers NOT_RUN when asked, the step runs
    again, no rank is named, the output exact. (On loopback a relayed plan was not seen to overtake
    the `ChaosStep` in two runs with the plan relayed; that it goes directly is the step loop's unit
    test, tests/control/serving/test_step_loop.py.)"""
    server.wait_full_group(4)
    pid, lost = server.pids()[1], lost_results(server).get("not_run", 0)
    since = server.cluster()["events"][-1]["time_s"]
    results = streams_with_fault(server.url, lambda: server.http.post("/chaos/lose_plan", json={"rank_id": 1})
                                 .raise_for_status(), PROMPTS, MAX_TOKENS, temperature=0)
    assert [r.text for r in results] == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    assert lost_results(server).get("not_run", 0) == lost + 1  # the fault landed: the plan never ran
    events = server.cluster()["events"]
    assert not [e for e in events if e["kind"] == "fault" and e["rank_id"] is not None and e["time_s"] > since]
    assert server.pids()[1] == pid


def test_a_stopped_agent_loses_its_nodes_plans_and_the_result_deadline_recovers_them(tmp_path):
    """`elastic-ep agent --step-plans-via agent` SIGSTOPped for 2 s mid-stream, with deadlines long
    enough that nothing is named for it: the plan it holds never arrives in time, the node's ranks
    asked for their answer directly say they never ran the step (NOT_RUN), the step is run again in
    a new epoch, no rank is named for it, and the output is exact. Results go directly here, so that
    what the stall catches is a plan."""
    server = Server(["--model", MODEL, "--ep-size", "4", "--local-ranks", "2", "--step-plans-via", "agent",
                     "--heartbeat-timeout-s", "10", "--agent-timeout-s", "10",
                     "--watchdog-floor-s", "10", "--lease-s", "30", "--result-timeout-floor-s", "0.5",
                     # the result deadline near its floor whatever the step times: at 10x the median of a
                     # loaded machine's first steps (1.35 s) it outlasted a 1.5 s stall, and the plan came
                     "--result-timeout-multiple", "2",
                     "--restart-delay-s", "-1", "--startup-timeout-s", "300"], tmp_path / "serve.log",
                    ready_timeout_s=None)
    agent = subprocess.Popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--controller", server.controller_addr(),
                              "--node", "node1", "--ranks", "2", "--cluster-key-file", str(server.key_file),
                              "--lease-s", "30", "--step-plans-via", "agent"],
                             stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        server.wait_ready(300)
        before = server.wait_full_group(4)

        def stall() -> None:
            os.kill(agent.pid, signal.SIGSTOP)
            time.sleep(2.0)
            os.kill(agent.pid, signal.SIGCONT)
        results = streams_with_fault(server.url, stall, PROMPTS, MAX_TOKENS, temperature=0)
        assert [r.text for r in results] == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
        lost = lost_results(server)
        assert lost.get("not_run", 0) >= 1 and not lost.get("unanswered"), lost
        after = server.cluster()
        assert not [e for e in after["events"] if e["kind"] == "fault" and e["time_s"] > before["events"][-1]["time_s"]]
        relayed = plans_out(server)["relayed"]
        again = streams_with_fault(server.url, lambda: None, PROMPTS[:2], MAX_TOKENS, temperature=0)
        assert [r.text for r in again] == list(reference(MODEL, tuple(PROMPTS[:2]), MAX_TOKENS))
        assert plans_out(server)["relayed"] > relayed  # relayed again once the agent runs
    finally:
        if agent.poll() is None:
            os.kill(agent.pid, signal.SIGCONT)
        server.stop()
        if agent.poll() is None:
            agent.kill()
        agent.wait()
