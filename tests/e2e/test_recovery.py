"""Fault tolerance end to end: 4 real ranks, concurrent streaming requests, a fault injected
mid-stream. Every request completes, its output equals the fault-free run, and /cluster and
/metrics show the new epoch, the culprit, the cause and the recovery.

One server serves the whole module: each test waits until the killed ranks have been
restarted (--restart-delay-s) and the group is back to 4 before it injects its fault.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.load import streams_with_fault as harness_streams_with_fault
from elastic_ep.node.netcut import cut_unavailable
from elastic_ep.placement.location import ExpertLocation

from .conftest import PROMPTS, Server, concurrently, reference

MAX_TOKENS = 48
MODEL = "tiny-deepseek-v3"
# 16 experts, 16 redundant: 8 slots per rank, so two ranks can hold every expert. The straggler
# policy stays off: these tests slow ranks to show that slowness is not a fault, and a derate
# epoch (tests/e2e/test_straggler.py) would change the epoch they check is unchanged.
SERVE_ARGS = ("--model", MODEL, "--ep-size", "4", "--redundant-experts", "16", "--enable-chaos",
              "--restart-delay-s", "1.0", "--admission-timeout-s", "2", "--straggler-policy", "off")


# how the agent words a rank that ended: "killed by SIGKILL" for a kill -9, "exited with code N" otherwise
EXITED = ("killed by SIGKILL", "exited with code")


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(*SERVE_ARGS)


def full_group(server) -> dict:
    return server.wait_full_group(4)


def recoveries(server) -> float:
    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return sum(s.value for f in families if f.name == "elastic_ep_recoveries" for s in f.samples
               if s.name.endswith("_total"))


def streams_with_fault(server, inject, prompts=PROMPTS, max_tokens=MAX_TOKENS, **sampling):
    """Stream `prompts` concurrently; call inject() once every stream has its first chunk.
    Returns the texts and the largest gap between chunks of any stream (s)."""
    results = harness_streams_with_fault(server.url, inject, prompts, max_tokens, **(sampling or {"temperature": 0}))
    return [r.text for r in results], max(r.largest_gap for r in results)


def recovery_events(cluster: dict, since_epoch: int) -> list[dict]:
    return [e for e in cluster["events"] if e["kind"] == "recovered" and e.get("epoch", -1) > since_epoch]


def warmups(cluster: dict, after_epoch: int) -> dict[int, dict]:
    """epoch -> its readiness gate's `warmup` event, for the epochs after `after_epoch`."""
    return {e["epoch"]: e for e in cluster["events"] if e["kind"] == "warmup" and e["epoch"] > after_epoch}


def check_recovered(server, before: dict, texts: list[str], culprits: set[int], cause: str | tuple[str, ...],
                    expected: tuple[str, ...] | None = None) -> dict:
    """Outputs equal the fault-free run; a newer epoch names `culprits`, each fault event with
    `cause` (or one of several) in its message."""
    causes = (cause,) if isinstance(cause, str) else cause
    assert texts == list(expected or reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    cluster = server.wait_for(lambda c: recovery_events(c, before["epoch"]), timeout_s=10, what="a recovery")
    assert cluster["epoch"] > before["epoch"]
    named = set().union(*(set(e["culprits"]) for e in recovery_events(cluster, before["epoch"])))
    assert culprits <= named
    faults = [e for e in cluster["events"] if e["kind"] == "fault" and e["rank_id"] in culprits
              and e["time_s"] > before["events"][-1]["time_s"]]
    assert faults and all(any(c in e["message"] for c in causes) for e in faults), faults
    return cluster


def test_kill_one_rank_then_it_rejoins(server):
    before = full_group(server)
    count = recoveries(server)
    pid = server.pids()[1]
    texts, _ = streams_with_fault(server, lambda: os.kill(pid, signal.SIGKILL))
    cluster = check_recovered(server, before, texts, {1}, EXITED)
    event = recovery_events(cluster, before["epoch"])[0]
    assert set(event["transfers"]) and event["total_s"] < 5
    assert recoveries(server) > count
    back = full_group(server)
    assert back["ranks"][1]["pid"] != pid
    # the restarted process has run no shape: the epoch it joins runs every one, on every member
    every_shape = back["cold_start"]["warmup"]["shapes"]
    joined = [w for epoch, w in warmups(back, event["epoch"]).items() if w["shapes"]]
    assert joined and all(w["shapes"] == every_shape for w in joined), joined


def rank_heartbeats(server) -> dict[str, float]:
    """node -> rank heartbeats the controller took from that node agent's NodeHeartbeats."""
    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return {s.labels["node"]: s.value for f in families if f.name == "elastic_ep_rank_heartbeats" for s in f.samples
            if s.name.endswith("_total")}


def test_hung_rank_is_named_fenced_and_replaced(server):
    before = full_group(server)
    beats = rank_heartbeats(server)
    pid = server.pids()[2]
    texts, _ = streams_with_fault(server, lambda: os.kill(pid, signal.SIGSTOP))
    # Heartbeat loss and the watchdog have the same 1 s bound; either may name it first.
    cluster = check_recovered(server, before, texts, {2}, ("heartbeat", "hung"))
    # the heartbeats came by the node's agent (one NodeHeartbeat per interval), none straight from a rank
    node = before["ranks"][2]["node"]
    assert rank_heartbeats(server)[node] > beats.get(node, 0)
    handled = cluster["control_times"]["handled"]
    assert handled["NodeHeartbeat"] > 0 and "Heartbeat" not in handled


def test_a_stall_of_the_serve_process_itself_fences_no_one(server):
    """The controller and this host's agent thread share the serve process: stopped together for
    longer than --agent-timeout-s and --heartbeat-timeout-s (1 s each), they must not read their
    own stall as the agent's and the ranks' silence (a false node loss would fence every rank)."""
    before = full_group(server)
    serve = psutil.Process(server.proc.pid)
    stopped = []

    def stall():
        serve.suspend()
        deadline = time.monotonic() + 1.0
        while serve.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:  # SIGSTOP lands async
            time.sleep(0.01)
        stopped.append(serve.status())
        time.sleep(1.5)
        serve.resume()

    texts, _ = streams_with_fault(server, stall)
    assert stopped == [psutil.STATUS_STOPPED]  # the stall landed on the serve process
    assert texts == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    cluster = server.cluster()
    since = [e for e in cluster["events"] if e["id"] > before["events"][-1]["id"]]
    assert not [e for e in since if e["kind"] in ("fault", "node-lost", "fencing")], since
    assert cluster["epoch"] == before["epoch"] and cluster["members"] == before["members"]


def test_rank_zero_lost_via_chaos_endpoint_with_seeded_sampling(server):
    before = full_group(server)
    kill = lambda: server.http.post("/chaos/kill", json={"rank_id": 0}).raise_for_status()  # noqa: E731
    texts, _ = streams_with_fault(server, kill, temperature=0.8, seed=11)
    expected = reference(MODEL, tuple(PROMPTS), MAX_TOKENS, 0.8, 11)
    check_recovered(server, before, texts, {0}, EXITED, expected)


def test_watchdog_names_a_rank_that_stops_entering_collectives(server):
    before = full_group(server)
    stall = lambda: server.http.post("/chaos/slow", json={"rank_id": 2, "delay_s": 4.0}).raise_for_status()  # noqa: E731
    texts, _ = streams_with_fault(server, stall)
    check_recovered(server, before, texts, {2}, "hung")


def test_two_ranks_at_once_losing_every_replica_of_some_experts_restores_from_backup(server):
    before = full_group(server)
    pair = _pair_holding_only_replicas(before["placement"])
    pids = server.pids()

    def kill_both():
        for r in pair:
            os.kill(pids[r], signal.SIGKILL)

    texts, _ = streams_with_fault(server, kill_both)
    cluster = check_recovered(server, before, texts, set(pair), EXITED)
    moved = {}
    warmed = warmups(cluster, before["epoch"])
    for e in recovery_events(cluster, before["epoch"]):
        for source, stat in e["transfers"].items():
            moved[source] = moved.get(source, 0) + stat["bytes"]
        # its warm-up ran the slots it filled, each once on its rank, and no forward: every
        # survivor had run every shape, and the slots it kept were warm from earlier epochs
        warm = warmed[e["epoch"]]
        assert warm["shapes"] == [] and warm["filled_slots_warmed"] == warm["slots_filled"] == e["verified_slots"], (
            warm, e["verified_slots"])
    assert moved.get("backup", 0) > 0 and moved.get("disk", 0) == 0
    assert sum(warmed[e["epoch"]]["filled_slots_warmed"] for e in recovery_events(cluster, before["epoch"])) > 0


def test_second_fault_lands_during_the_recovery_of_the_first(server):
    before = full_group(server)
    pids = server.pids()
    last_id = before["events"][-1]["id"]

    def two_faults():
        # rank 3 is killed by the controller right after it announces the recovery epoch
        server.http.post("/chaos/kill", json={"rank_id": 3, "at_next_epoch": True}).raise_for_status()
        server.wait_for(lambda c: any(e["kind"] == "chaos" and "armed" in e["message"] for e in c["events"]
                                      if e["id"] > last_id), what="the armed kill")
        os.kill(pids[1], signal.SIGKILL)

    texts, _ = streams_with_fault(server, two_faults)
    cluster = check_recovered(server, before, texts, {1, 3}, EXITED)
    (record,) = recovery_events(cluster, before["epoch"])  # one recovery, extended by the second fault
    assert record["culprits"] == [1, 3] and "; then rank 3" in record["cause"], record
    kill = next(e for e in cluster["events"] if e["kind"] == "chaos" and e["id"] > last_id
                and e["message"].startswith("SIGKILL"))
    assert f"in epoch {before['epoch'] + 1}" in kill["message"]  # the epoch the first recovery announced


def test_a_corrupted_expert_slot_is_found_and_refilled_from_a_clean_copy(server):
    before = full_group(server)
    last_id = before["events"][-1]["id"]
    done = server.http.post("/chaos/corrupt", json={"rank_id": 2}).json()

    def refilled(c):
        return any(e["kind"] == "epoch" and "refill" in e["message"] for e in c["events"] if e["id"] > last_id)

    cluster = server.wait_for(refilled, timeout_s=20, what="the refill epoch")
    found = [e for e in cluster["events"] if e["kind"] == "verify-failed" and e["id"] > last_id]
    assert found[0]["slots"] == [[2, done["layer"], done["slot"]]]
    refill = next(e for e in cluster["events"]
                  if e["kind"] == "epoch" and "refill" in e["message"] and e["id"] > last_id)
    assert sum(stat["bytes"] for source, stat in refill["transfers"].items() if source != "local") > 0
    assert concurrently(lambda p: server.complete(p, MAX_TOKENS, temperature=0), PROMPTS) == list(
        reference(MODEL, tuple(PROMPTS), MAX_TOKENS))


def test_slow_rank_and_a_short_stop_are_not_declared_dead(server):
    before = full_group(server)
    chaos = lambda action, **body: server.http.post(f"/chaos/{action}", json={"rank_id": 3, **body})  # noqa: E731
    chaos("slow", delay_s=0.3).raise_for_status()
    try:
        texts = concurrently(lambda p: server.complete(p, 8, temperature=0), PROMPTS[:2])
    finally:
        chaos("slow", delay_s=0.0).raise_for_status()
    chaos("hang").raise_for_status()
    time.sleep(0.3)
    chaos("resume").raise_for_status()
    texts += [server.complete(PROMPTS[2], 8, temperature=0)]
    assert texts == list(reference(MODEL, tuple(PROMPTS[:3]), 8))
    after = server.cluster()
    assert after["epoch"] == before["epoch"]
    assert not [e for e in after["events"] if e["kind"] == "fault" and e["time_s"] > before["events"][-1]["time_s"]]


def lost_results(server, outcome: str) -> float:
    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return sum(s.value for f in families if f.name == "elastic_ep_lost_step_results" for s in f.samples
               if s.name.endswith("_total") and s.labels["outcome"] == outcome)


def test_a_lost_step_answer_is_asked_for_again_and_the_output_is_exact(server):
    """Rank 2 runs a step but its StepResult never reaches the controller, every rank heartbeating:
    past the result deadline the controller asks for it again, the rank sends the answer it kept,
    and the streams go on in the same epoch with the fault-free output."""
    before = full_group(server)
    resent = lost_results(server, "resent")
    texts, _ = streams_with_fault(server, lambda: server.http.post("/chaos/lose", json={"rank_id": 2})
                                  .raise_for_status())
    assert texts == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    assert lost_results(server, "resent") == resent + 1
    after = server.cluster()
    assert after["epoch"] == before["epoch"]  # no recovery: nothing was recomputed
    since = before["events"][-1]["time_s"]
    assert [e["ranks"] for e in after["events"] if e["kind"] == "resend" and e["time_s"] > since] == [[2]]
    assert not [e for e in after["events"] if e["kind"] == "fault" and e["time_s"] > since]


def test_a_lost_plan_is_asked_for_and_its_step_run_again_not_a_hang(server):
    """Rank 2's plan of a step never arrives (/chaos/lose_plan): its peers enter the step's first
    all-to-all and wait for it while it heartbeats "idle". The watchdog does not call that a hang
    (no healthy rank fenced): past the result deadline the rank is asked for its answer, says it
    never ran the step, and the step runs again with the fault-free output; rank 2 keeps its pid."""
    before = full_group(server)
    pid = server.pids()[2]
    not_run = lost_results(server, "not_run")
    texts, _ = streams_with_fault(server, lambda: server.http.post("/chaos/lose_plan", json={"rank_id": 2})
                                  .raise_for_status())
    assert texts == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    assert lost_results(server, "not_run") == not_run + 1  # the fault landed: rank 2 said it never ran it
    after = server.cluster()
    since = before["events"][-1]["time_s"]
    assert [e["ranks"] for e in after["events"] if e["kind"] == "resend" and e["time_s"] > since] == [[2]]
    assert not [e for e in after["events"] if e["kind"] == "fault" and e["rank_id"] is not None
                and e["time_s"] > since], "a rank was named for a lost plan"
    assert server.pids()[2] == pid


def test_too_few_ranks_not_ready_then_503_then_service_returns_by_itself(server_factory):
    # restarted after 4 s, past the 2 s admission timeout: a rank forked from the zygote is back
    # within a second of its restart, before the late request's wait would end
    server = server_factory(*SERVE_ARGS, "--restart-delay-s", "4")
    try:
        full_group(server)
        pids = server.pids()
        results = {}

        def kill_three_and_probe():
            for r in (0, 1, 2):
                os.kill(pids[r], signal.SIGKILL)
            cluster = server.wait_for(lambda c: not c["ready"], timeout_s=10, what="not ready")
            ready = server.http.get("/ready")
            results["ready"] = (ready.status_code, ready.text, cluster["reason"])
            late = server.http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2})
            results["late"] = (late.status_code, late.headers.get("retry-after"), late.text)

        texts, gap = streams_with_fault(server, kill_three_and_probe)
        assert texts == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
        status, _, reason = results["ready"]
        assert status == 503 and "too few ranks" in reason
        late_status, retry_after, late_body = results["late"]
        assert late_status == 503 and retry_after and "too few ranks" in late_body
        assert gap > 1.0  # the streams paused until the ranks came back
        full_group(server)
    finally:
        server.stop()


def test_backup_off_restores_lost_experts_from_disk(server_factory):
    server = server_factory(*SERVE_ARGS, "--no-expert-backup")
    try:
        before = full_group(server)
        pair = _pair_holding_only_replicas(before["placement"])
        pids = server.pids()
        texts, _ = streams_with_fault(server, lambda: [os.kill(pids[r], signal.SIGKILL) for r in pair])
        cluster = check_recovered(server, before, texts, set(pair), EXITED)
        disk = sum(e["transfers"].get("disk", {}).get("bytes", 0) for e in recovery_events(cluster, before["epoch"]))
        assert disk > 0
    finally:
        server.stop()


def _pair_holding_only_replicas(placement: dict) -> tuple[int, int]:
    """Two ranks that together hold every replica of at least one expert."""
    location = ExpertLocation.from_json(json.dumps(placement))  # /cluster sends the slot map alone
    s = location.slots_per_rank
    best, best_lost = (0, 1), -1
    for a, b in itertools.combinations(range(location.num_ranks), 2):
        lost = 0
        for layer in location.log2phy.tolist():
            for slots in layer:
                holders = {slot // s for slot in slots if slot >= 0}
                lost += holders <= {a, b}
        if lost > best_lost:
            best, best_lost = (a, b), lost
    assert best_lost > 0
    return best


def test_two_nodes_keep_each_others_backup_and_survive_a_kill(tmp_path):
    """Node0 runs ranks 0-2, node1 rank 3. The backup of an expert lives on the node after its
    first replica's node, so the experts only rank 0 held are backed up on node1, and the restore
    puts them on node1's rank 3, which reads them from its own node's backup: nothing crosses
    nodes and nothing comes from disk."""
    server = Server(["--model", MODEL, "--ep-size", "4", "--local-ranks", "3", "--redundant-experts", "8",
                     "--restart-delay-s", "-1"], tmp_path / "serve.log", ready_timeout_s=None)
    agent = subprocess.Popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--controller", server.controller_addr(),
                              "--node", "node1", "--ranks", "1", "--cluster-key-file", str(server.key_file)])
    try:
        server.wait_ready()
        before = server.wait_for(lambda c: sum(e["kind"] == "backup" for e in c["events"]) == 2, what="2 backups")
        assert {r["rank_id"]: r["node"] for r in before["ranks"]} == {0: "node0", 1: "node0", 2: "node0", 3: "node1"}
        pid = server.pids()[0]
        texts, _ = streams_with_fault(server, lambda: os.kill(pid, signal.SIGKILL))
        cluster = check_recovered(server, before, texts, {0}, EXITED)
        moved = {k: v["bytes"] for k, v in recovery_events(cluster, before["epoch"])[0]["transfers"].items()}
        assert moved["backup"] > 0 and moved.get("backup_remote", 0) == 0 and moved.get("disk", 0) == 0, moved
        server.stop()
        assert agent.wait(20) == 0  # the controller's shutdown stops the other node's agent too
    finally:
        server.stop()
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_streams_end_with_the_reason_when_too_few_ranks_stay_too_few(server_factory):
    server = server_factory("--model", MODEL, "--ep-size", "2", "--redundant-experts", "0", "--restart-delay-s", "-1",
                            "--degraded-timeout-s", "1.5", "--admission-timeout-s", "1")
    pid = server.pids()[1]
    start = time.monotonic()
    with pytest.raises(openai.APIError, match="too few ranks"):
        streams_with_fault(server, lambda: os.kill(pid, signal.SIGKILL), prompts=PROMPTS[:2], max_tokens=400)
    assert time.monotonic() - start < 15
    assert server.http.get("/ready").status_code == 503
    late = server.http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2})
    assert late.status_code == 503 and "too few ranks" in late.text
    server.stop()


def test_events_older_than_the_last_50_are_reachable(server):
    everything = server.http.get("/cluster", params={"events": 0}).json()["events"]
    assert len(everything) > 50  # this module's faults, fences, epochs and rejoins
    ids = [e["id"] for e in everything]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert server.cluster()["events"] == everything[-50:]
    since = server.http.get("/cluster", params={"since": ids[-60], "events": 0}).json()["events"]
    assert [e["id"] for e in since] == ids[-59:]


CUT_UNAVAILABLE = cut_unavailable()


@pytest.mark.skipif(bool(CUT_UNAVAILABLE), reason=f"links cannot be cut here: {CUT_UNAVAILABLE}")
def test_a_cut_rank_is_named_by_its_silence_fenced_and_replaced(server):
    before = full_group(server)
    pid = server.pids()[2]
    cut = lambda: server.http.post("/chaos/cut", json={"rank_id": 2, "duration_s": 60}).raise_for_status()  # noqa: E731
    texts, _ = streams_with_fault(server, cut)
    # a cut rank is alive but silent: named by its heartbeats or the watchdog, never by an exit
    cluster = check_recovered(server, before, texts, {2}, ("heartbeat", "hung"))
    fenced = [e for e in cluster["events"] if e["kind"] == "fencing" and e["id"] > before["events"][-1]["id"]]
    assert fenced and not psutil.pid_exists(pid)  # its agent, still reachable, killed it


@pytest.mark.skipif(bool(CUT_UNAVAILABLE), reason=f"links cannot be cut here: {CUT_UNAVAILABLE}")
def test_a_short_cut_healed_in_time_is_no_fault(server):
    before = full_group(server)
    chaos = lambda action: server.http.post(f"/chaos/{action}", json={"rank_id": 3}).raise_for_status()  # noqa: E731
    chaos("cut")
    time.sleep(0.1)  # shorter than TCP's first retransmission timeout (200 ms): heartbeats are late, not lost
    chaos("heal")
    texts = concurrently(lambda p: server.complete(p, 8, temperature=0), PROMPTS[:3])
    assert texts == list(reference(MODEL, tuple(PROMPTS[:3]), 8))
    after = server.cluster()
    assert after["epoch"] == before["epoch"]
    assert not [e for e in after["events"] if e["kind"] == "fault" and e["id"] > before["events"][-1]["id"]]
    assert [e["message"] for e in after["events"] if e["kind"] == "chaos" and e["id"] > before["events"][-1]["id"]] \
        == ["cut the links of rank 3", "heal the links of rank 3"]


def test_the_default_serve_survives_a_kill_without_waiting_for_the_restart(server_factory):
    """`serve --ep-size 4` with no redundancy flag (auto) holds every expert on 3 ranks: a kill -9
    is recovered on the others at once; restarts are off, so nothing came back to help."""
    server = server_factory("--model", MODEL, "--ep-size", "4", "--restart-delay-s", "-1")
    try:
        before = server.wait_full_group(4)
        redundancy = before["redundancy"]
        assert redundancy["chosen"] == "auto" and redundancy["survives"]["rank_losses"] >= 1
        pid = server.pids()[1]
        texts, _ = streams_with_fault(server, lambda: os.kill(pid, signal.SIGKILL))
        cluster = check_recovered(server, before, texts, {1}, EXITED)
        # served on by the three left: rank 1 is not restarted, so the streams waited for nothing
        assert cluster["ready"] and sorted(cluster["members"]) == [0, 2, 3]
    finally:
        server.stop()
