"""What the control thread publishes each time it pumps: readiness (with the stall check) and
health at once; at most every `throttle_s` the `/cluster` snapshot with every rank's liveness and
straggler verdict, and the liveness gauges of `/metrics`; and the periodic stats line of the log.

Why readiness has a stall check of its own: the fencing deadlines are raised for large models (a
real step can take seconds) and for drills, and until they act a hung group looked ready. `/ready`
turns false as soon as the step in flight runs past the stall deadline (--stall-multiple x the
median recent step time, at least --stall-floor-s) or a member has been silent that long, and
true again once steps move; a load balancer stops sending here, and the watchdog still decides
alone whom to fence.

`/health` answers whether this process is worth keeping (a Kubernetes liveness probe, vLLM's
`/health`): "ok", or "degraded" with the reason (not ready; a rank stalled, suspect or down; a
rank the straggler verdict names) while the control loop runs, since restarting the whole
instance would not mend a rank that elastic EP fences and replaces by itself; "dead" (HTTP 503)
only once the control loop has stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from elastic_ep.model.block_manager import BlockManager
from elastic_ep.policy.straggler_verdict import IntervalRecorder, Verdict, VerdictKind, judge

from ..api import Health, Readiness
from ..cluster import ClusterState
from ..config import ServeConfig
from ..events import EventKind
from ..faults.detector import FaultDetector
from ..faults.health_rules import adaptive_deadline_s, rank_liveness, stall_reason
from ..metrics import ClusterMetrics
from ..ranks import Liveness, RankLiveness, RankStatus
from ..serving.scheduler import Sequence
from ..timing import ControlTimes
from .engine import Published
from .stats_log import StatsLog, Throughput


class StepView(Protocol):
    """The step loop, read: the step in flight and what the steps measured."""

    in_step: set[int]
    replies: Mapping[int, object]
    started_at: float
    own_time: IntervalRecorder
    tokens_run: int
    tokens_sampled: int


class QueueView(Protocol):
    """The scheduler, read."""

    running: Mapping[int, list[Sequence]]
    waiting: Any
    pools: Mapping[int, BlockManager]

    def num_requests(self, rank_id: int) -> int: ...

    def pool_view(self, max_model_len: int) -> dict[str, Any]: ...


SNAPSHOT_SHARE = 0.05  # most of the control thread's time the /cluster snapshot may take
# how often the published liveness (and the readiness and health worked out from it) is renewed at
# most: a walk over every rank each, 50 times a second at --health-check-period-s 0.02 (~8% of the
# control thread at 1,024 ranks) for readers that poll every second or so; the detector's own
# check, which names the faults, keeps --health-check-period-s
PUBLISHED_LIVENESS_S = 0.1
LIVE = RankLiveness(Liveness.LIVE)


class Publisher:
    """Built with what it reads (the cluster state, the detector's step times, the step loop, the
    scheduler), what it writes (`published`, the metrics), the control plane's `heard()` clock and
    address, and `views(now)`: the other roles' top-level /cluster fields (scale, straggler
    policy, standbys, hardware, rebalance, ...), `slow_delays()` (chaos, by rank), `derated()`
    (the straggler policy's derated ranks and weights) and `times`: the control plane's timers
    (control/timing.py), shown in /cluster."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, detector: FaultDetector, steps: StepView,
                 scheduler: QueueView, published: Published, metrics: ClusterMetrics, *, heard: Callable[[], float],
                 controller_addr: str, views: Callable[[float], dict[str, Any]],
                 slow_delays: Callable[[], Mapping[int, float]],
                 derated: Callable[[], Mapping[int, float]] = dict, times: ControlTimes | None = None):
        self.cluster = cluster
        self.cfg = cfg
        self.detector = detector
        self.steps = steps
        self.scheduler = scheduler
        self.published = published
        self.metrics = metrics
        self.heard = heard
        self.controller_addr = controller_addr
        self.views = views
        self.slow_delays = slow_delays
        self.times = times or ControlTimes()  # the control plane's timers: the snapshot's build time goes there
        self.derated = derated  # the straggler policy's derated ranks: exported first in /metrics
        self.rule = cfg.straggler_rule()
        self.stats = StatsLog(cfg.log_stats_interval_s, time.monotonic())
        self._published_at = 0.0
        self._stalled_since: float | None = None
        self._liveness: dict[int, RankLiveness] | None = None
        self._liveness_at = 0.0
        self._judged_for: tuple[Readiness, str] | None = None  # (the cluster's readiness, fatal) last judged on
        self.liveness_period_s = max(cfg.health_check_period_s, PUBLISHED_LIVENESS_S)  # the benchmark's --before: 0
        self.snapshot_share = SNAPSHOT_SHARE  # --before: inf (every throttle_s whatever the build takes)
        self._verdicts: dict[int, Verdict] = {}  # of the members, as the last snapshot judged them
        self.throughput = Throughput()

    def stall_deadline_s(self) -> float:
        cfg = self.cfg
        return adaptive_deadline_s(self.detector.recent_step_s, cfg.stall_multiple, cfg.stall_floor_s)

    def liveness(self, now: float, heard: float) -> dict[int, RankLiveness]:
        """Liveness of every rank whose process should be running (`RankInfo.watched`); `now` is
        monotonic, `heard` the control plane's heard clock (heartbeat ages)."""
        steps = self.steps
        step_age_s = now - steps.started_at if steps.in_step else None
        stall_s, suspect_s = self.stall_deadline_s(), self.cfg.heartbeat_suspect_s
        beating = self.cfg.health_checks  # without health checks workers send no heartbeats
        if beating and (step_age_s is None or step_age_s < stall_s):
            # no step stalled: a rank heard within both deadlines is live (rank_liveness's last case),
            # decided without a call per rank (this runs every PUBLISHED_LIVENESS_S over every rank)
            heard_since = heard - min(stall_s, suspect_s)
            return {r.rank_id: LIVE if r.last_heartbeat > heard_since else
                    rank_liveness(heard - r.last_heartbeat, step_age_s, False, r.progress.phase, suspect_s, stall_s)
                    for r in self.cluster.ranks.values() if r.watched}
        return {r.rank_id: rank_liveness(heard - r.last_heartbeat if beating else 0.0, step_age_s,
                                         r.rank_id in steps.in_step and r.rank_id not in steps.replies,
                                         r.progress.phase, suspect_s, stall_s)
                for r in self.cluster.ranks.values() if r.watched}

    def health(self, readiness: Readiness, liveness: dict[int, RankLiveness]) -> Health:
        fatal = self.published.fatal
        if fatal:
            return Health("dead", f"the control loop stopped: {fatal}")
        # not ready already names the stalled ranks; else name the suspect and stalled ones
        problems = [f"not ready: {readiness.reason}"] if not readiness.ready else [
            f"rank {r} {lv.state.value}: {lv.reason}" for r, lv in sorted(liveness.items())
            if lv.state in (Liveness.SUSPECT, Liveness.STALLED)]
        problems += [f"rank {r.rank_id} {r.status.value}" for r in self.cluster.ranks.values()
                     if r.status.down or r.status == RankStatus.FENCING]
        problems += [f"rank {r} is a straggler: {v.ratio:.1f}x the own time per step of its peers"
                     for r, v in sorted(self._verdicts.items()) if v.kind == VerdictKind.STRAGGLER]
        return Health("degraded", "; ".join(problems)) if problems else Health("ok")

    def publish(self, throttle_s: float = 0.0) -> None:
        """Readiness and health at once (liveness at most every PUBLISHED_LIVENESS_S); the /cluster
        snapshot and gauges at most every `throttle_s`, and never more often than keeps their build
        under `SNAPSHOT_SHARE` of the control thread's time (a large cluster's snapshot is refreshed
        less often rather than delaying steps)."""
        c, steps, sched = self.cluster, self.steps, self.scheduler
        now, heard = time.monotonic(), self.heard()
        fresh = not (throttle_s and now - self._liveness_at < self.liveness_period_s and self._liveness is not None)
        if fresh:
            self._liveness = self.liveness(now, heard)
            self._liveness_at = now
        liveness = self._liveness
        snapshot_due = not throttle_s or now - self._published_at >= max(throttle_s, self.times.snapshot_s
                                                                          / self.snapshot_share)
        # readiness and health are worked out again with the liveness they read (at most every
        # PUBLISHED_LIVENESS_S), a snapshot, or a change of the cluster's own readiness; the
        # pumps in between (every few ms while a step runs) cost no walk over the ranks
        if fresh or snapshot_due or self._judged_for != (c.readiness, self.published.fatal):
            self._judged_for = (c.readiness, self.published.fatal)
            step_age_s = now - steps.started_at if steps.in_step else None
            members = set(c.members)
            stalled = stall_reason(step_age_s, self.stall_deadline_s(),
                                   {r: lv for r, lv in liveness.items() if r in members}) if c.readiness.ready else None
            readiness = Readiness(False, stalled) if stalled else c.readiness
            self._note_stall(now, stalled)
            if snapshot_due:  # before health, which names the stragglers
                verdicts = judge(steps.own_time.intervals(now), self.rule, now, c.members)
                self._verdicts = {r: v for r, v in verdicts.items() if r in members}
            self.published.readiness, self.published.health = readiness, self.health(readiness, liveness)
        readiness, health = self.published.readiness, self.published.health
        if self.stats.due(now):
            self.stats.maybe_log(now, c, (c.step, steps.tokens_run, steps.tokens_sampled),
                                 sum(len(seqs) for seqs in sched.running.values()), len(sched.waiting), readiness)
        if not snapshot_due:
            return
        t0 = time.perf_counter()  # the snapshot's build (the verdicts above are not counted)
        self._published_at = now
        self.throughput.add(now, (c.step, steps.tokens_run, steps.tokens_sampled))
        deadlines = {**self.cfg.deadlines(), "watchdog_deadline_s": round(self.detector.watchdog_deadline_s(), 3),
                     "stall_deadline_s": round(self.stall_deadline_s(), 3), "stall_multiple": self.cfg.stall_multiple,
                     "result_deadline_s": round(self.detector.result_deadline_s(), 3),
                     "result_timeout_multiple": self.cfg.result_timeout_multiple}
        self.published.snapshot = c.snapshot(
            sched.num_requests, self.slow_delays(), self.controller_addr, deadlines, readiness, liveness, heard,
            {r: v.to_json() for r, v in self._verdicts.items()},
            health=vars(health), load=self.load(), straggler_rule=self.rule.to_json(), **self.views(now),
            data_plane={**self.cfg.data_plane(), "nodes": c.member_nodes()},
            kv_cache=sched.pool_view(self.cfg.max_model_len), control_times=self.times.view())
        self._set_gauges(heard, readiness, health, liveness, self._verdicts)
        self.times.snapshot_s = time.perf_counter() - t0

    def load(self) -> dict[str, float | int | None]:
        """Requests running and waiting now, and the throughput of the last seconds (`/cluster` `load`)."""
        scheduler = self.scheduler
        return {"running": sum(len(seqs) for seqs in scheduler.running.values()),
                "waiting": len(scheduler.waiting), **self.throughput.rates()}

    def _note_stall(self, now: float, stalled: str | None) -> None:
        """One event when the group stalls and one when it moves again (not one per publish)."""
        events = self.cluster.events
        if stalled and self._stalled_since is None:
            self._stalled_since = now
            events.add(EventKind.STALLED, stalled)
        elif not stalled and self._stalled_since is not None:
            events.add(EventKind.STALL_ENDED, f"no longer stalled after {now - self._stalled_since:.1f}s: no step "
                       "in flight is past the stall deadline and no member is silent")
            self._stalled_since = None

    def _set_gauges(self, heard: float, readiness: Readiness, health: Health, liveness: dict[int, RankLiveness],
                    verdicts: dict[int, Verdict]) -> None:
        c, m = self.cluster, self.metrics
        unix_now = time.time()
        up, stalled, heartbeat_age, progress_at, flagged = {}, {}, {}, {}, {}
        member_set = set(c.members)  # a list's `in` per rank was quadratic in the ranks
        for r in c.ranks.values():
            rank_id, lv = r.rank_id, liveness.get(r.rank_id)
            serving = rank_id in member_set and r.status in (RankStatus.SERVING, RankStatus.DRAINING)
            up[rank_id] = int(serving and lv is not None and lv.state != Liveness.STALLED)
            stalled[rank_id] = lv.stalled_s or 0.0 if lv is not None else 0.0
            if r.last_heartbeat:
                heartbeat_age[rank_id] = heard - r.last_heartbeat
            if r.progress_at:
                progress_at[rank_id] = unix_now - (heard - r.progress_at)
            if r.status.down or r.status == RankStatus.FENCING:
                flagged[rank_id] = "down"
            elif lv is not None and lv.state in (Liveness.STALLED, Liveness.SUSPECT):
                flagged[rank_id] = lv.state.value
        derated = self.derated()
        for rank_id in derated:
            flagged.setdefault(rank_id, "derated")
        for rank_id, v in verdicts.items():
            if v.kind in (VerdictKind.STRAGGLER, VerdictKind.DP_HEAVY) and flagged.get(rank_id) in (None, "derated"):
                flagged[rank_id] = v.kind.value
        # the slots' tokens of each member's last steps over the mean: with the snapshot, not every step
        # (a walk over every member's window), since /metrics is read every few seconds at most
        members = [r for r in c.members if r in c.ranks]
        slot_totals = c.timings.sums("slot_tokens", members, [c.ranks[r].record for r in members])
        mean = float(slot_totals.sum()) / max(len(members), 1)
        if mean:
            m.ranks.set_gauge("elastic_ep_expert_load_imbalance", dict(zip(members, (slot_totals / mean).tolist(),
                                                                            strict=True)))
        for name, values in (("elastic_ep_rank_up", up), ("elastic_ep_rank_stalled_seconds", stalled),
                             ("elastic_ep_rank_heartbeat_age_seconds", heartbeat_age),
                             ("elastic_ep_rank_last_progress_timestamp_seconds", progress_at)):
            m.ranks.set_gauge(name, values)
        m.ranks.select(flagged, c.ranks.keys(), time.monotonic())
        m.ranks_up.set(sum(up.values()))
        m.ranks_stalled.set(sum(lv.state == Liveness.STALLED for lv in liveness.values()))
        m.straggler_ranks.set(sum(v.kind == VerdictKind.STRAGGLER for v in verdicts.values()))
        m.derated_ranks.set(len(derated))
        m.requests_running.set(sum(len(seqs) for seqs in self.scheduler.running.values()))
        m.requests_waiting.set(len(self.scheduler.waiting))
        pools = self.scheduler.pools
        m.kv_cache_usage.set({r: (p.num_blocks - p.num_free_blocks, p.num_blocks) for r, p in pools.items()})
        m.prefix_cached_blocks.set(sum(p.num_cached_blocks for p in pools.values()))
        m.ready.set(int(readiness.ready))
        m.degraded.set(int(health.status == "degraded"))
