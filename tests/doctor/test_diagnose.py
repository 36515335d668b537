"""The doctor's rules on real /cluster and /metrics snapshots.

data/ holds what a 4-rank tiny-deepseek-v3 server (`serve --ep-size 4 --enable-chaos` with
60 s heartbeat and watchdog deadlines, three clients streaming) answered: busy.* while serving,
slow.* after `chaos slow` of 0.05 s on rank 2 (pid 12321), hang.json and hang2.json one second
apart after SIGSTOP of rank 1 (pid 12319). Variants are edits of those snapshots.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from elastic_ep.doctor.diagnose import (
    ProcessInfo,
    Thresholds,
    diagnose,
    diagnose_balance,
    diagnose_hang,
    diagnose_membership,
    diagnose_processes,
    diagnose_stragglers,
)
from elastic_ep.doctor.findings import render
from elastic_ep.doctor.metrics import parse_metrics, rank_windows

DATA = Path(__file__).parent / "data"


def snapshot(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def samples(name: str):
    return parse_metrics((DATA / f"{name}.metrics").read_text())


def named(findings, kind: str) -> list[int]:
    return [ref.rank_id for f in findings if f.kind == kind for ref in f.ranks]


def rank(cluster: dict, rank_id: int) -> dict:
    return next(r for r in cluster["ranks"] if r["rank_id"] == rank_id)


def frozen(**progress: dict) -> tuple[dict, dict]:
    """The hang snapshots with each rank's progress (rank "r<id>") set the same in both."""
    before, after = snapshot("hang"), snapshot("hang2")
    for c in (before, after):
        for key, fields in progress.items():
            rank(c, int(key[1:]))["progress"].update(fields)
    return before, after


def test_stopped_rank_is_named_as_the_one_the_others_wait_for():
    findings = diagnose_hang(snapshot("hang"), snapshot("hang2"), 1.0)
    assert [f.kind for f in findings] == ["hang"]
    hang = findings[0]
    assert hang.severity == "critical"
    assert [(r.rank_id, r.node, r.pid) for r in hang.ranks] == [(1, "node0", 12319)]
    assert hang.evidence["waiting"] == [0, 2, 3]
    assert "ranks [0, 2, 3] wait in collective #1009" in hang.symptom
    text = render(hang)
    assert "rank 1 (node0, pid 12319)" in text and "collective #1009" in text
    assert all(part in text for part in ("[CRITICAL] hang:", "suspicion:", "check:", "action:"))


def test_a_running_cluster_is_not_a_hang():
    # one snapshot shows ranks out of step (heartbeats are sampled), but steps and progress move
    assert diagnose_hang(snapshot("busy"), snapshot("slow"), 1.0) == []
    moved = snapshot("hang2")
    rank(moved, 0)["progress"]["layer"] = 2
    assert diagnose_hang(snapshot("hang"), moved, 1.0) == []


def test_ranks_stopped_mid_all_to_all_leave_victims_at_different_counts_and_the_culprit_is_named():
    # seen live: rank 1 stopped while sending its dispatch, so rank 2 still waits in #811 and
    # ranks 0 and 3, which got their rows, wait in #812
    at = {"step": 136, "layer": 1}
    before, after = frozen(r0={**at, "seq": 812, "phase": "combine"}, r1={**at, "seq": 810, "phase": "compute"},
                           r2={**at, "seq": 811, "phase": "dispatch"}, r3={**at, "seq": 812, "phase": "combine"})
    assert named(diagnose_hang(before, after, 1.0), "hang") == [1]
    # its last heartbeat may already say it entered #811: remotely both ranks at #811 are suspects,
    # on its machine the stopped process settles it
    before, after = frozen(r0={**at, "seq": 812, "phase": "combine"}, r1={**at, "seq": 811, "phase": "dispatch"},
                           r2={**at, "seq": 811, "phase": "dispatch"}, r3={**at, "seq": 812, "phase": "combine"})
    assert named(diagnose_hang(before, after, 1.0), "hang") == [1, 2]
    assert named(diagnose_hang(before, after, 1.0, {1: ProcessInfo("stopped")}), "hang") == [1]


def test_rank_alone_behind_all_others_is_named_though_it_reports_being_in_a_collective():
    # seen live: the stopped rank's last heartbeat said #729; the others wait in #733 and #734
    at = {"step": 123, "layer": 1}
    before, after = frozen(r0={**at, "seq": 734, "phase": "combine"}, r1={**at, "seq": 729, "phase": "dispatch"},
                           r2={**at, "seq": 733, "phase": "dispatch"}, r3={**at, "seq": 734, "phase": "combine"})
    findings = diagnose_hang(before, after, 1.0)
    assert named(findings, "hang") == [1] and "it stopped inside it" in findings[0].suspicion


def test_rank_one_collective_ahead_is_a_different_execution_path():
    before, after = frozen(r1={"seq": 1010, "step": 169, "layer": 1, "phase": "combine"})
    findings = diagnose_hang(before, after, 1.0)
    assert named(findings, "path") == [1] and named(findings, "hang") == []
    assert "different execution path" in findings[0].suspicion


def test_rank_at_the_same_count_but_another_layer_is_a_different_execution_path():
    before, after = frozen(r3={"layer": 2, "phase": "combine"},
                           r1={"seq": 1009, "step": 169, "layer": 1, "phase": "dispatch"})
    assert named(diagnose_hang(before, after, 1.0), "path") == [3]


def test_when_all_wait_in_one_collective_the_stopped_process_is_named():
    before, after = frozen(r1={"seq": 1009, "step": 169, "layer": 1, "phase": "dispatch"})
    findings = diagnose_hang(before, after, 1.0, {1: ProcessInfo("stopped"), 0: ProcessInfo("sleeping")})
    assert named(findings, "hang") == [1]
    assert named(diagnose_processes(after, {1: ProcessInfo("stopped")}), "process") == [1]
    assert named(diagnose_hang(before, after, 1.0), "hang") == [0, 1, 2, 3]


def test_injected_slow_rank_is_the_straggler_and_called_slow_not_bad():
    windows = rank_windows(samples("busy"), samples("slow"))
    assert windows[2].steps == 55 and windows[2].own_ms > 40 > windows[0].own_ms
    findings = diagnose_stragglers(snapshot("slow"), windows)
    assert named(findings, "straggler") == [2]
    assert "slow, not bad" in findings[0].suspicion and "chaos slow" in findings[0].suspicion
    assert "--delay-s 0" in findings[0].action
    everything = diagnose(snapshot("busy"), snapshot("slow"), 4.0, 1795974219.0, samples("busy"), samples("slow"))
    assert [f.kind for f in everything] == ["straggler"]


def test_even_ranks_have_no_straggler():
    assert diagnose_stragglers(snapshot("busy")) == []
    # the straggler rule on /cluster's percentiles alone (no /metrics window)
    slow = snapshot("busy")
    rank(slow, 3)["step_ms"]["p50"] = 40.0
    assert named(diagnose_stragglers(slow), "straggler") == [3]
    assert diagnose_stragglers(slow, th=Thresholds(straggler_ratio=10.0)) == []


def test_uneven_dp_tokens_and_hot_expert_slots_are_named():
    busy = snapshot("busy")
    base = samples("busy")
    assert diagnose_balance(busy, base) == []
    uneven = dict(base)
    for r, v in {0: 200.0, 1: 10.0, 2: 10.0, 3: 12.0}.items():
        uneven[("elastic_ep_rank_step_tokens", (("rank", str(r)),))] = v
    uneven[("elastic_ep_dp_token_imbalance", ())] = 200.0 / 58.0
    uneven[("elastic_ep_expert_load_imbalance", (("rank", "2"),))] = 1.8
    findings = diagnose_balance(busy, uneven)
    assert named(findings, "dp-imbalance") == [0]
    assert named(findings, "expert-imbalance") == [2]


def test_too_few_ranks_is_critical_and_names_the_ranks_out_of_service():
    c = snapshot("hang2")
    c["ready"] = False
    c["reason"] = "too few ranks: 1 live ranks x 4 slots cannot hold 16 experts (need 4 ranks)"
    for r in (1, 2, 3):
        rank(c, r)["state"] = "dead"
    findings = diagnose_membership(c, now_s=c["events"][-1]["time_s"])
    assert [f.kind for f in findings] == ["not-ready"]
    assert named(findings, "not-ready") == [1, 2, 3]
    assert "1 serving x 4 slots < 16 experts" in findings[0].suspicion
    assert "restart by themselves after --restart-delay-s 5.0" in findings[0].action
    c["deadlines"]["restart_delay_s"] = -1.0
    assert "not restarted" in diagnose_membership(c, now_s=c["events"][-1]["time_s"])[0].action


def test_recent_faults_and_failed_recoveries_are_reported_old_ones_not():
    c = snapshot("hang2")
    t = c["events"][-1]["time_s"]
    c["events"] += [
        {"time_s": t + 1, "kind": "fault", "rank_id": 1, "message": "rank 1: hung", "cause": "hung"},
        {"time_s": t + 2, "kind": "epoch-failed", "rank_id": None, "message": "epoch 1 did not form"},
    ]
    findings = diagnose_membership(c, now_s=t + 3)
    assert {f.kind: f.severity for f in findings} == {"faults": "warning", "recovery-failed": "warning"}
    assert named(findings, "faults") == [1]
    c["events"].append({"time_s": t + 4, "kind": "recovered", "rank_id": None, "message": "serving again"})
    assert {f.kind: f.severity for f in diagnose_membership(c, now_s=t + 5)}["faults"] == "info"
    assert diagnose_membership(c, now_s=t + 5 + Thresholds().events_window_s) == []


@pytest.mark.parametrize("state", ["zombie", "gone"])
def test_dead_process_of_a_serving_rank_is_reported(state):
    c = snapshot("busy")
    assert named(diagnose_processes(c, {2: ProcessInfo(state), 0: ProcessInfo("running")}), "process") == [2]
    dead = copy.deepcopy(c)
    rank(dead, 2)["state"] = "dead"
    assert diagnose_processes(dead, {2: ProcessInfo(state)}) == []
