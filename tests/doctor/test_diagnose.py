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
    diagnose_expert_balance,
    diagnose_hang,
    diagnose_membership,
    diagnose_processes,
    diagnose_stragglers,
    verdicts,
)
from elastic_ep.doctor.findings import render
from elastic_ep.doctor.metrics import parse_metrics, scrape_intervals
from elastic_ep.policy.straggler_verdict import StragglerRule

DATA = Path(__file__).parent / "data"


def snapshot(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def samples(name: str):
    return parse_metrics((DATA / f"{name}.metrics").read_text())


def named(findings, kind: str) -> list[int]:
    return [ref.rank_id for f in findings if f.kind == kind for ref in f.ranks]


def rank(cluster: dict, rank_id: int) -> dict:
    return next(r for r in cluster["ranks"] if r["rank_id"] == rank_id)


def scrapes(per_rank: dict[int, tuple[float, float]], count: int = 5, steps: int = 10) -> list:
    """`count` scrapes 0.25 s apart of counters that grow by `steps` steps per interval; per rank
    (own ms per step, tokens per step), with 1 ms of collective wait per step."""
    out = []
    for k in range(count):
        samples = {}
        for r, (own_ms, tokens) in per_rank.items():
            label = (("rank", str(r)),)
            n = k * steps
            samples[("elastic_ep_rank_step_seconds_count", label)] = float(n)
            samples[("elastic_ep_rank_step_seconds_sum", label)] = n * (own_ms + 1.0) / 1000
            samples[("elastic_ep_rank_collective_wait_seconds_sum", label)] = n * 1.0 / 1000
            samples[("elastic_ep_rank_tokens_total", label)] = float(n * tokens)
        out.append((k * 0.25, samples))
    return out


def stepping() -> tuple[dict, dict]:
    """Two /cluster snapshots of the busy server, steps moving between them (no hang)."""
    before, after = snapshot("busy"), snapshot("busy")
    after["step"] += 10
    return before, after


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
    recorded = [(0.0, samples("busy")), (4.0, samples("slow"))]  # the server then exported no tokens
    [interval] = scrape_intervals(recorded)
    assert interval.ranks[2].steps == 55 and interval.ranks[2].own_ms_per_step > 40 > interval.ranks[0].own_ms_per_step
    one_interval = StragglerRule(min_intervals=1)  # two recorded scrapes: one interval
    findings = diagnose_stragglers(snapshot("slow"), verdicts(snapshot("slow"), [interval], one_interval))
    assert named(findings, "straggler") == [2]
    assert "slow, not bad" in findings[0].suspicion and "chaos slow" in findings[0].suspicion
    assert "--delay-s 0" in findings[0].action
    assert "55 steps in 1 intervals" in findings[0].symptom
    everything, judged = diagnose(snapshot("busy"), snapshot("slow"), 4.0, 1795974219.0, recorded,
                                  th=Thresholds(straggler=one_interval))
    assert [f.kind for f in everything] == ["straggler"]
    assert {r: v.kind.value for r, v in judged.items()} == {0: "ok", 1: "ok", 2: "straggler", 3: "ok"}


def test_more_tokens_is_dp_imbalance_and_never_a_straggler():
    """One request at a time: rank 0 holds it and takes 1.9x the others' own time per step."""
    findings, judged = diagnose(*stepping(), 1.0, 0.0, scrapes({0: (9.5, 1), 1: (5.0, 0), 2: (5.0, 0), 3: (5.0, 0)}))
    assert [(f.kind, named([f], f.kind)) for f in findings] == [("dp-imbalance", [0])]
    assert "runs 1.00 tokens/step against 0.00 on the others" in findings[0].symptom
    assert "kill -9" not in findings[0].action


def test_no_straggler_and_no_kill_advice_without_fresh_steps():
    before, slow = stepping()
    rank(slow, 3)["step_ms"]["p50"] = 40.0  # old percentiles in /cluster say rank 3 was slow
    idle = scrapes({0: (5.0, 1), 3: (40.0, 1)}, steps=0)
    findings, judged = diagnose(before, slow, 1.0, 0.0, idle)
    assert findings == [] and {v.kind.value for v in judged.values()} == {"unknown"}
    few = scrapes({0: (5.0, 1), 1: (5.0, 1), 3: (40.0, 1)}, steps=2)  # 8 steps: fewer than min_steps
    findings, judged = diagnose(before, slow, 1.0, 0.0, few)
    assert findings == [] and "8 steps in 4 intervals" in judged[3].evidence


def test_even_ranks_have_no_straggler_and_the_ratio_can_be_raised():
    even = scrapes({0: (5.0, 1), 1: (5.2, 1), 2: (4.9, 1), 3: (5.1, 1)})
    assert diagnose(*stepping(), 1.0, 0.0, even)[0] == []
    slow = scrapes({0: (5.0, 1), 1: (5.2, 1), 2: (4.9, 1), 3: (40.0, 1)})
    assert named(diagnose(*stepping(), 1.0, 0.0, slow)[0], "straggler") == [3]
    assert diagnose(*stepping(), 1.0, 0.0, slow, th=Thresholds(straggler=StragglerRule(ratio=10.0)))[0] == []


def test_hot_expert_slots_are_named():
    busy = snapshot("busy")
    base = samples("busy")
    assert diagnose_expert_balance(busy, base) == []
    hot = dict(base)
    hot[("elastic_ep_expert_load_imbalance", (("rank", "2"),))] = 1.8
    assert named(diagnose_expert_balance(busy, hot), "expert-imbalance") == [2]


def test_a_rank_derated_by_the_straggler_policy_is_light_on_purpose():
    # rank 3, derated to speed 0.2, computes a fifth of the others' share: in time the group is even
    light = {k: v for k, v in samples("busy").items() if k[0] != "elastic_ep_expert_load_imbalance"}
    for rank, share in {0: 1.35, 1: 1.2, 2: 1.2, 3: 0.25}.items():
        light[("elastic_ep_expert_load_imbalance", (("rank", str(rank)),))] = share
    assert named(diagnose_expert_balance(snapshot("busy"), light), "expert-imbalance") == [0]
    derated = {**snapshot("busy"), "straggler_policy": {"derated": {"3": {"speed": 0.2}}}}
    assert diagnose_expert_balance(derated, light) == []
    light[("elastic_ep_expert_load_imbalance", (("rank", "0"),))] = 2.0
    assert named(diagnose_expert_balance(derated, light), "expert-imbalance") == [0]


def test_no_eplb_advice_for_a_derated_rank_while_slow_or_after():
    # rank 2 derated to speed 0.2 keeps its slots, so it still computes half the others' share:
    # in time that looks hot, but it is the derate's doing; once it is restored the loads are even
    derated = {**snapshot("busy"), "straggler_policy": {"derated": {"2": {"speed": 0.2}}}}
    light = {k: v for k, v in samples("busy").items() if k[0] != "elastic_ep_expert_load_imbalance"}
    for rank, share in {0: 1.17, 1: 1.17, 2: 0.5, 3: 1.16}.items():
        light[("elastic_ep_expert_load_imbalance", (("rank", str(rank)),))] = share
    assert diagnose_expert_balance(derated, light) == []
    restored = {**snapshot("busy"), "straggler_policy": {"derated": {}}}
    for rank in range(4):
        light[("elastic_ep_expert_load_imbalance", (("rank", str(rank)),))] = 1.0
    assert diagnose_expert_balance(restored, light) == []


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


def test_a_start_the_os_refused_names_the_rank_the_node_and_what_to_check_there():
    c = snapshot("hang2")
    t = c["events"][-1]["time_s"]
    c["events"].append({"time_s": t + 1, "kind": "start-failed", "rank_id": 2, "node": "node0",
                        "reason": "Cannot allocate memory (OSError)",
                        "message": "rank 2 could not be started on node0: Cannot allocate memory (OSError)"})
    finding, = diagnose_membership(c, now_s=t + 2)
    assert (finding.kind, finding.severity, named([finding], "start-failed")) == ("start-failed", "warning", [2])
    assert "on node0: free -m" in finding.check and "pids.max" in finding.check
    assert "Cannot allocate memory" in finding.symptom
    assert diagnose_membership(c, now_s=t + 2 + Thresholds().events_window_s) == []


@pytest.mark.parametrize("state", ["zombie", "gone"])
def test_dead_process_of_a_serving_rank_is_reported(state):
    c = snapshot("busy")
    assert named(diagnose_processes(c, {2: ProcessInfo(state), 0: ProcessInfo("running")}), "process") == [2]
    dead = copy.deepcopy(c)
    rank(dead, 2)["state"] = "dead"
    assert diagnose_processes(dead, {2: ProcessInfo(state)}) == []
