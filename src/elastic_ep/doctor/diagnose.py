"""Diagnosis of a running cluster from GET /cluster snapshots (and /metrics): pure functions
from snapshot dicts to `Finding`s, so every rule is testable without processes.

The questions are docs/RUNBOOK.md's (symptom -> suspicion -> check -> action): which rank has not entered the
collective the others wait in (a hang), which
rank ran a different execution path, which rank always arrives last (a straggler: slow, not
bad) or runs more tokens (DP imbalance) by the straggler verdict the server itself shows
(`policy/straggler.py`, judged here on the doctor's own /metrics window), whether expert load is
uneven, and whether a recovery failed or too few ranks are left to hold every expert.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from elastic_ep.policy.straggler_verdict import Interval, StragglerRule, Verdict, VerdictKind, judge

from .findings import Finding, rank_refs
from .metrics import Samples, per_rank, scrape_intervals

COLLECTIVE_PHASES = ("dispatch", "combine")
FAILED_RECOVERY_EVENTS = ("epoch-failed", "verify-failed", "fence-timeout", "fatal", "request-error")
DEAD_PROCESS_STATES = ("stopped", "zombie", "dead", "gone")


@dataclass(frozen=True)
class Thresholds:
    """straggler: the straggler verdict's rule (the server's, from /cluster, unless overridden).
    expert_imbalance: a rank's expert-slot tokens over the mean. events_window_s: how far back
    events count as recent."""

    straggler: StragglerRule = field(default_factory=StragglerRule)
    expert_imbalance: float = 1.3
    events_window_s: float = 600.0


@dataclass(frozen=True)
class ProcessInfo:
    """A rank's process as seen on the doctor's machine (psutil status; "gone": no such pid)."""

    status: str
    cpu_percent: float | None = None


def members(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    ids = set(cluster.get("members", []))
    return [r for r in cluster.get("ranks", []) if r["rank_id"] in ids]


def _progress(rank: dict[str, Any]) -> dict[str, Any]:
    return rank.get("progress") or {}


def _seq(rank: dict[str, Any], epoch: int) -> int:
    """Collectives the rank entered in `epoch` (0 if it has not reported that epoch yet)."""
    p = _progress(rank)
    return int(p.get("seq", 0)) if p.get("epoch") == epoch else 0


def _place(p: dict[str, Any]) -> tuple[Any, Any, Any]:
    return p.get("step"), p.get("layer"), p.get("phase")


def where(p: dict[str, Any]) -> str:
    return f"step {p.get('step')} layer {p.get('layer')} {p.get('phase')}"


def describe(p: dict[str, Any]) -> str:
    return f"{where(p)} (collective #{p.get('seq')})"


def _ids(ranks: list[dict[str, Any]]) -> list[int]:
    return [r["rank_id"] for r in ranks]


def _waiting_summary(ranks: list[dict[str, Any]], seqs: dict[int, int]) -> str:
    """'ranks [0, 3] wait in collective #812 at step 136 layer 1 combine; ranks [2] wait in ...'."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        if _progress(r).get("phase") in COLLECTIVE_PHASES:
            groups.setdefault(seqs[r["rank_id"]], []).append(r)
    return "; ".join(
        f"ranks {_ids(group)} wait in collective #{seq} at {where(_progress(group[0]))}"
        for seq, group in sorted(groups.items(), reverse=True)
    )


def diagnose_hang(
    before: dict[str, Any], after: dict[str, Any], interval_s: float,
    processes: dict[int, ProcessInfo] | None = None,
) -> list[Finding]:
    """A hang: no step completed and no rank's progress moved between the two snapshots
    (taken interval_s apart) while ranks wait in a collective.

    The rank named, strongest evidence first: a member whose process is stopped or gone (when
    the doctor runs on its machine); a member outside any collective while the others wait (it
    has not entered the one they wait in); one rank alone behind all others; a lone rank ahead
    of all others, or at the same count but another layer or phase (a different execution
    path); all ranks, when all sit in one collective; else the ranks furthest behind. A peer
    stopped in the middle of an all-to-all lets some ranks finish that collective and not
    others, so waiting ranks at different counts are victims, not culprits.
    """
    ranks = members(after)
    epoch = after.get("epoch", -1)
    if not ranks or after.get("step") != before.get("step") or epoch != before.get("epoch"):
        return []
    waiting = [r for r in ranks if _progress(r).get("phase") in COLLECTIVE_PHASES]
    earlier = {r["rank_id"]: _progress(r) for r in members(before)}
    # Heartbeats report progress every ~0.1 s, so ranks of a running cluster look out of step in
    # one snapshot; only progress frozen across both snapshots is a hang.
    if not waiting or any(earlier.get(r["rank_id"]) != _progress(r) for r in ranks):
        return []
    seqs = {r["rank_id"]: _seq(r, epoch) for r in ranks}
    requests = sum(int(r.get("requests") or 0) for r in ranks)
    symptom = (f"no step completed and no rank moved in {interval_s:.1f}s (step {after.get('step')}, "
               f"{requests} requests in flight): {_waiting_summary(ranks, seqs)}")
    deadlines = after.get("deadlines", {})
    evidence = {"waiting": _ids(waiting), "seq": seqs}
    check = ("`elastic-ep doctor URL --py-spy` (py-spy dump of every rank on this machine) to see where each "
             "stands; on the named rank's node: process state (ps -o stat -p PID: T = stopped), GPU Xid / ECC "
             "errors, NIC link")
    action = (f"the watchdog fences a rank that lags {deadlines.get('watchdog_deadline_s', '?')}s and a rank "
              f"without heartbeats after {deadlines.get('heartbeat_timeout_s', '?')}s; to act now kill -9 the "
              "named pid on its node (or `elastic-ep chaos URL kill RANK` on a --enable-chaos server): the group "
              "re-forms without it and it restarts after --restart-delay-s")
    at = {r["rank_id"]: describe(_progress(r)) for r in ranks}
    stopped = {r: p.status for r, p in (processes or {}).items() if r in seqs and p.status in DEAD_PROCESS_STATES}
    outside = [r["rank_id"] for r in ranks if r not in waiting]
    if stopped or outside:
        culprits = sorted(stopped) or outside
        detail = "; ".join(f"rank {r} last reported {at[r]}" + (f", its process is {stopped[r]}" if r in stopped
                                                                 else ", outside any collective")
                           for r in culprits)
        return [Finding(
            "hang", "critical", symptom,
            f"rank(s) {culprits} hold the others: {detail}; it has not entered the collective they wait in "
            "(a dead, stopped or stuck process: one rank dead or stuck holds every collective)",
            check, action, rank_refs(after, culprits), evidence,
        )]
    counts = Counter(seqs.values())
    common_seq = counts.most_common(1)[0][0]
    odd = [r for r, s in seqs.items() if s != common_seq]
    if len(counts) == 1:
        places = Counter(_place(_progress(r)) for r in ranks)
        odd = [r["rank_id"] for r in ranks if _place(_progress(r)) != places.most_common(1)[0][0]]
    lone_odd = len(odd) == 1 and len(ranks) > 2 and seqs[odd[0]] >= common_seq
    low = min(seqs.values())
    behind = [r for r, s in seqs.items() if s == low]
    if len(counts) > 1 and (len(behind) == 1 or not lone_odd):
        return [Finding(
            "hang", "critical", symptom,
            f"rank(s) {behind} are furthest behind, at {', '.join(at[r] for r in behind)}; the others passed "
            "that collective, so " + ("it stopped inside it" if len(behind) == 1 else "one of these stopped "
                                      "inside it or runs a different path")
            + " (its last report may be one heartbeat old; run the doctor on its node to see the process state)",
            check, action, rank_refs(after, behind), evidence,
        )]
    if lone_odd:
        return [Finding(
            "path", "critical", symptom,
            f"different execution path: rank {odd[0]} is at {at[odd[0]]} while every other rank is at collective "
            f"#{common_seq}; it ran one collective more, or another one, than the others (a rank on another "
            f"code path); or, one collective ahead, it got its rows from a rank at #{common_seq} that stopped in "
            "the middle of the all-to-all (process states on the ranks' node tell)",
            "compare ranks[].progress in GET /cluster; py-spy dump of this pid against a waiting rank's",
            "fence the odd rank (kill -9 its pid) so the group re-forms; keep the step's inputs: every rank must "
            "run every MoE layer's collectives, even with no tokens, and a rank that does not is a bug",
            rank_refs(after, odd), evidence,
        )]
    return [Finding(
        "hang", "critical", symptom,
        f"every rank entered collective #{common_seq} and none left it: a cut data-plane link, or a rank "
        "stopped inside it (run the doctor on the ranks' node to see process states)",
        check, action, rank_refs(after, _ids(ranks)), evidence,
    )]


def diagnose_processes(cluster: dict[str, Any], processes: dict[int, ProcessInfo]) -> list[Finding]:
    """Ranks listed as live whose process on this machine is stopped, a zombie or gone."""
    live = {r["rank_id"]: r for r in cluster.get("ranks", []) if r.get("state") not in ("dead", "fenced")}
    bad = {r: p.status for r, p in processes.items() if r in live and p.status in DEAD_PROCESS_STATES}
    if not bad:
        return []
    return [Finding(
        "process", "critical",
        "process state of rank(s) " + ", ".join(f"{r}: {s}" for r, s in sorted(bad.items())),
        "stopped: SIGSTOP or a debugger holds it (its heartbeats stop too); zombie / gone: it died and the "
        "agent has not reported it yet",
        "ps -o pid,stat,cmd -p PID on its node (T = stopped, Z = zombie)",
        "kill -CONT PID to let a stopped rank go on, or kill -9 PID to fence it now; the cluster re-forms",
        rank_refs(cluster, bad), {"status": bad},
    )]


def verdicts(cluster: dict[str, Any], intervals: list[Interval], rule: StragglerRule) -> dict[int, Verdict]:
    """The straggler verdict (policy/straggler.py, the server's own rule) of every member over the
    doctor's intervals, judged at the end of the last one."""
    now_s = max((i.end_s for i in intervals), default=0.0)
    return judge(intervals, rule, now_s, [r["rank_id"] for r in members(cluster)])


def diagnose_stragglers(cluster: dict[str, Any], verdicts: dict[int, Verdict]) -> list[Finding]:
    """Stragglers (same or fewer tokens than their peers, more own time, persistently) and DP
    imbalance (more tokens per step), from the verdicts; a rank without enough fresh steps is
    neither, whatever its averages say."""
    by_id = {r["rank_id"]: r for r in cluster.get("ranks", [])}
    findings = []
    for rank, v in sorted(verdicts.items()):
        if v.kind == VerdictKind.STRAGGLER:
            delay_s = float(by_id.get(rank, {}).get("slow_delay_s") or 0.0)
            cause = (f"an injected delay of {delay_s}s per step is set on it (chaos slow)" if delay_s > 0 else
                     "a throttled or erroring GPU (clocks, ECC), a degraded link, a noisy neighbour, or more expert "
                     "load on its slots")
            findings.append(Finding(
                "straggler", "warning", f"rank {rank} arrives last: {v.evidence}",
                f"slow, not bad: it still steps, so no detector fires and the watchdog deadline grows with the step "
                f"time: a slow rank is not a broken one, and only per-rank timings show it; "
                f"it ran no more tokens than the ranks it is compared with; {cause}",
                f"the slow node radar (GET /dashboard) and `verdict` in GET /cluster; "
                f"elastic_ep_rank_step_seconds{{rank=\"{rank}\"}} in /metrics; on its node nvidia-smi -q -d "
                "CLOCK,ECC,PERFORMANCE and the NIC error counters",
                (f"`elastic-ep chaos URL slow {rank} --delay-s 0` clears the injected delay" if delay_s > 0 else
                 "cordon it: kill -9 its pid (the group re-forms without it) and repair the node; or serve with "
                 "--eplb-speed-aware so the next rebalance gives it less expert load"),
                rank_refs(cluster, [rank]), v.to_json(),
            ))
        elif v.kind == VerdictKind.DP_HEAVY:
            findings.append(Finding(
                "dp-imbalance", "warning", f"rank {rank} runs more tokens than the others: {v.evidence}",
                "DP attention load is uneven (few requests, or long prompts on few ranks): the others wait for it at "
                "every all-to-all; the card itself is not slower",
                "requests per rank in GET /cluster, elastic_ep_rank_tokens_total and elastic_ep_rank_step_tokens in "
                "/metrics, over several scrapes (`elastic-ep doctor URL --watch 5`)",
                "nothing to cordon; with more concurrent requests the scheduler evens tokens per rank; lower "
                "--max-num-batched-tokens so chunked prefill evens the steps of long prompts",
                rank_refs(cluster, [rank]), v.to_json(),
            ))
    return findings


def diagnose_expert_balance(cluster: dict[str, Any], samples: Samples, th: Thresholds = Thresholds()) -> list[Finding]:
    """Expert load imbalance: tokens a rank's expert slots computed over the mean, from /metrics.
    Ranks the straggler policy derated are left out and the others judged among themselves: a
    derated rank's load is the derate's doing, and re-placing experts would not mend it (a slow
    card is the straggler finding's, not EPLB's)."""
    ids = set(cluster.get("members", []))
    derated = sorted(int(r) for r in ((cluster.get("straggler_policy") or {}).get("derated") or {}))
    load = {r: v for r, v in per_rank(samples, "elastic_ep_expert_load_imbalance").items()
            if r in ids and r not in derated}
    if derated and load:
        mean = sum(load.values()) / len(load)
        load = {r: v / mean for r, v in load.items()} if mean > 0 else {}
    if not load or max(load.values()) < th.expert_imbalance:
        return []
    hot = max(load, key=load.get)
    return [Finding(
        "expert-imbalance", "warning",
        f"rank {hot}'s expert slots compute {load[hot]:.2f}x the mean tokens"
        f"{f' of the ranks not derated (derated: {derated})' if derated else ''} (per rank: "
        f"{ {r: round(v, 2) for r, v in sorted(load.items())} })",
        "hot experts sit on this rank: every all-to-all waits for its expert compute",
        "POST /start_expert_distribution_record, serve a while, POST /dump_expert_distribution_record; "
        "elastic_ep_expert_load_imbalance in /metrics",
        "`elastic-ep eplb --load DUMP` to see the better placement; serve with --enable-eplb (and "
        "--redundant-experts) to apply it online",
        rank_refs(cluster, [hot]), {"expert_load_imbalance": load, "derated": derated},
    )]


def diagnose_membership(cluster: dict[str, Any], now_s: float, th: Thresholds = Thresholds()) -> list[Finding]:
    """Not ready (with the server's reason; too few ranks to hold every expert), ranks out of
    service, recoveries that failed and recent faults, from /cluster's state and events."""
    findings = []
    not_serving = [r for r in cluster.get("ranks", []) if r.get("state") not in ("serving", "standby")]
    if not cluster.get("ready", True):
        placement = cluster.get("placement") or {}
        live = [r for r in cluster.get("ranks", []) if r.get("state") == "serving"]
        slots = int(cluster.get("slots_per_rank") or 0)
        experts = placement.get("num_experts")
        too_few = experts is not None and len(live) * slots < experts
        reason = cluster.get("reason", "")
        restart_s = (cluster.get("deadlines") or {}).get("restart_delay_s")
        restart = ("dead ranks are not restarted (--restart-delay-s is negative)" if restart_s is not None
                   and restart_s < 0 else f"dead ranks restart by themselves after --restart-delay-s {restart_s}")
        findings.append(Finding(
            "not-ready", "critical", f"GET /ready is false: {reason}",
            (f"too few ranks: {len(live)} serving x {slots} slots < {experts} experts, so some expert has no "
             "replica" if too_few or "too few" in reason else "the cluster is starting or re-forming"),
            "GET /ready, the events in GET /cluster, and the states of the ranks named here",
            (f"{restart}; else start one with `elastic-ep agent --controller ADDR` on a healthy node, or serve "
             "with more ranks / --redundant-experts"
             if too_few or "too few" in reason else "wait for the epoch to form; if it does not, see the events"),
            rank_refs(cluster, _ids(not_serving)),
            {"reason": reason, "serving": _ids(live), "slots_per_rank": slots, "num_experts": experts},
        ))
    events = [e for e in cluster.get("events", []) if now_s - float(e.get("time_s", 0)) <= th.events_window_s]
    failed = [e for e in events if e.get("kind") in FAILED_RECOVERY_EVENTS]
    if failed:
        findings.append(Finding(
            "recovery-failed", "warning",
            f"{len(failed)} failed recovery step(s) in the last {th.events_window_s:.0f}s: "
            + "; ".join(f"{e['kind']}: {e['message']}" for e in failed[-3:]),
            "an epoch that did not form, slots that failed verification, a fence an agent did not confirm, or "
            "requests ended because the cluster could not serve",
            "GET /cluster events (kind, message), the server log around those times",
            "a failed epoch is retried by itself; a fence-timeout means the node's agent is gone: check the node",
            rank_refs(cluster, sorted({e["rank_id"] for e in failed if e.get("rank_id") is not None})),
            {"events": failed[-10:]},
        ))
    refused = [e for e in events if e.get("kind") == "start-failed"]
    if refused:
        nodes = sorted({str(e.get("node")) for e in refused})
        findings.append(Finding(
            "start-failed", "warning",
            f"{len(refused)} rank start(s) refused by the OS in the last {th.events_window_s:.0f}s: "
            + "; ".join(e["message"] for e in refused[-3:]),
            "the node could not create the worker's process: memory (`Cannot allocate memory`), its process "
            "limit (`Resource temporarily unavailable`: the cgroup's pids.max, ulimit -u), or its command line",
            f"on {', '.join(nodes)}: free -m, the agent's cgroup pids.current / pids.max, ulimit -u, dmesg",
            "free memory or raise the limit on that node; the rank is started again after --restart-delay-s "
            "(by its agent's backoff with --auto-recover), or drain the node (POST /drain {\"node\": ...})",
            rank_refs(cluster, sorted({e["rank_id"] for e in refused if e.get("rank_id") is not None})),
            {"events": refused[-10:]},
        ))
    faults = [e for e in events if e.get("kind") == "fault"]
    if faults:
        last_recovered = max((float(e["time_s"]) for e in events if e.get("kind") == "recovered"), default=None)
        pending = last_recovered is None or last_recovered < float(faults[-1]["time_s"])
        findings.append(Finding(
            "faults", "warning" if pending else "info",
            f"{len(faults)} fault(s) in the last {th.events_window_s:.0f}s: "
            + "; ".join(e["message"] for e in faults[-5:]),
            "dead or hung ranks that were fenced; the same rank again and again points at its node",
            "GET /cluster events (fault, fencing, epoch, recovered) and elastic_ep_recoveries_total in /metrics",
            ("recovery of the last fault has not completed yet: see the not-ready finding" if pending else
             "recovered; repair the node of a rank that keeps failing"),
            rank_refs(cluster, sorted({e["rank_id"] for e in faults if e.get("rank_id") is not None})),
            {"events": faults[-10:], "recovered_since": not pending},
        ))
    return findings


def diagnose(
    before: dict[str, Any], after: dict[str, Any], interval_s: float, now_s: float,
    scrapes: list[tuple[float, Samples]] | None = None, processes: dict[int, ProcessInfo] | None = None,
    th: Thresholds = Thresholds(),
) -> tuple[list[Finding], dict[int, Verdict]]:
    """Every rule over two /cluster snapshots interval_s apart and the /metrics scrapes (time_s,
    samples) between them; critical findings first, and the straggler verdict of every member."""
    processes = processes or {}
    judged = verdicts(after, scrape_intervals(scrapes or []), th.straggler)
    findings = (
        diagnose_hang(before, after, interval_s, processes)
        + diagnose_processes(after, processes)
        + diagnose_membership(after, now_s, th)
        + diagnose_stragglers(after, judged)
        + (diagnose_expert_balance(after, scrapes[-1][1], th) if scrapes else [])
    )
    order = {"critical": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order[f.severity]), judged
