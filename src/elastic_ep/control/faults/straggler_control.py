"""The straggler policy in the controller: judge the members' verdicts while a step runs, and at the
next step boundary decide with the policy of `policy/straggler_policy.py` and carry out its decisions.

- derate / restore: a placement with per-rank speed weights (the derated ranks' weights), made
  now as an epoch with the same members, so the slow rank gets the lighter replicas (the same
  speed-aware placement EPLB uses). A membership change made elsewhere (recovery, rejoin, scale)
  places without weights, so the weights are applied again in an epoch of their own after it;
  after a recovery only once its first step completed: before it, that epoch (a placement and an
  epoch change over every member, 2-3 s at 1,024 stand-in ranks) was in the fault's pause.
- evict: the rank becomes a fault of cause `evicted`; recovery fences it, takes a standby into
  the next epoch when one stands by (else the group serves one rank short) and retires the rank
  instead of restarting it (its card is suspect); a replacement process is started at once, which
  joins when it registers, or stands by when a standby already took the place.
- every decision is a `straggler` event with the verdict's evidence and the node's hardware
  signals. A slow rank is never a fault for the detector: only this policy evicts, and only as
  the limits allow (`policy/straggler_policy.py`).
The judgement runs once per verdict interval (--straggler-window-s / 10), the review that acts on
it at the next boundary of a ready cluster with no scale in flight. From OFF_THREAD_RANKS members
on, the weighted placement is computed off the control thread (`compute`; epochs/off_thread.py: at
1,024 stand-in ranks it held the thread 0.3-0.8 s, unread heartbeats, BENCHMARKS "Placements off the
control thread"), and its epoch forms at the first boundary after it is there.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

import numpy as np

from elastic_ep.policy.straggler_policy import Decision, DecisionKind, PolicyState, StragglerAction, decide
from elastic_ep.policy.straggler_verdict import INTERVALS_PER_WINDOW, IntervalRecorder, Verdict, judge

from ..cluster import ClusterState
from ..config import ServeConfig
from ..epochs.epoch_change import EpochReport, NoPlacement
from ..epochs.off_thread import OffThread
from ..epochs.rebalance_rules import plan_rebalance
from ..epochs.requests import EpochRequest, Reweight
from ..events import EventKind
from .detector import Fault, FaultCause
from .health_rules import relative_speeds


class StragglerControl:
    """Built with the cluster state, the per-rank own-time recorder the step loop fills, and the
    callables `standbys()` (how many stand by), `fault(Fault)`, `replace_later(rank_id)` (a
    replacement process after the fence), `pending()` (a fault waits for recovery),
    `evidence(node)` (the node's hardware signals), `load()` ([L, E]), `form(EpochRequest,
    reason)` (the loop's epoch change), `recovering()` (a recovery has not yet completed its
    first step) and `compute(fn, *args)` (a Future of `fn(*args)` off the control thread; None:
    placements computed here)."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, own_time: IntervalRecorder, *,
                 standbys: Callable[[], int], fault: Callable[[Fault], None], replace_later: Callable[[int], None],
                 pending: Callable[[], bool], evidence: Callable[[str], Any], load: Callable[[], np.ndarray],
                 form: Callable[[EpochRequest, str], EpochReport | NoPlacement], recovering: Callable[[], bool],
                 compute: Callable[..., cf.Future] | None = None):
        self.cluster = cluster
        self.cfg = cfg
        self.own_time = own_time
        self.standbys = standbys
        self.fault = fault
        self.replace_later = replace_later
        self.pending = pending
        self.evidence = evidence
        self.load = load
        self.form = form
        self.recovering = recovering
        self.rule = cfg.straggler_rule()
        self.policy = cfg.straggler_policy_params()
        self.state = PolicyState()
        self.interval_s = self.rule.window_s / INTERVALS_PER_WINDOW
        self._judged_at = float("-inf")  # when `judge` last judged
        self._verdicts: tuple[int, dict[int, Verdict]] | None = None  # (epoch, verdicts) judged, not yet acted on
        self._placed: tuple[int, dict[int, float]] = (-1, {})  # (epoch, weights) of the last weighted placement
        self.placing = OffThread(compute)  # the weighted placement, for (members, weights)
        self._why = ""  # what the placement under way is for

    def placement_speeds(self) -> dict[int, float] | None:
        """Speed weights for any placement over the members: each rank's measured speed with
        --eplb-speed-aware, each derated rank at most its derate weight; None when there is neither."""
        c, derated = self.cluster, self.derated()
        if not self.cfg.eplb_speed_aware:
            return derated or None
        measured = relative_speeds({r: c.timings.window("own_s", r, c.ranks[r].record) for r in c.members})
        return {**measured, **{r: min(measured.get(r, 1.0), s) for r, s in derated.items()}}

    def derated(self) -> dict[int, float]:
        members = self.cluster.members
        return {r: s for r, s in self.state.speeds().items() if r in members}

    def judge(self, now: float) -> None:
        """Every review interval, the verdicts on the members' closed intervals, kept for the next
        `review` (which acts on them). Judging reads every member's intervals (milliseconds at 256
        ranks), so the controller judges while a step runs (its housekeeping), not at the step
        boundary the ranks wait through; verdicts of an epoch gone by are dropped unread."""
        if self.policy.action == StragglerAction.OFF or now - self._judged_at < self.interval_s:
            return
        c = self.cluster
        self._judged_at = now
        self._verdicts = (c.epoch, judge(self.own_time.intervals(now), self.rule, now, c.members))

    def review(self, now: float) -> bool:
        """Act on the verdicts `judge` kept, if any; True when it changed the epoch or left a fault
        for recovery."""
        c = self.cluster
        if self.policy.action == StragglerAction.OFF:
            return False
        judged = self._verdicts
        self._verdicts = None
        if judged is None or judged[0] != c.epoch:  # none, or of an epoch gone by: a placement computed meanwhile
            return self.placing.ready and self._place([])
        self.state, decisions = decide(self.state, self.policy, judged[1], now, c.members, c.min_ranks,
                                       self.standbys())
        for d in decisions:
            self._announce(d)
            if d.kind == DecisionKind.EVICT:
                assert d.rank_id is not None
                self.fault(Fault(d.rank_id, FaultCause.EVICTED, d.reason))
                self.replace_later(d.rank_id)
        if self.pending():
            return True
        return self._place(decisions)

    def _place(self, decisions: list[Decision]) -> bool:
        """A placement with the current weights when they changed, or an epoch formed without them;
        not before a recovery's first step (it stays due until then)."""
        c = self.cluster
        if self.recovering():
            return False
        weights = self.derated()
        placed_epoch, placed = self._placed
        # an epoch made elsewhere (recovery, rejoin, scale) placed without weights
        if weights:
            due = weights != placed or placed_epoch != c.epoch
        else:
            due = bool(placed) and placed_epoch == c.epoch
        if not due:
            return False
        key = (tuple(c.members), tuple(sorted(weights.items())))
        if not self.placing.asked(key):
            assert c.location is not None
            self._why = ", ".join([f"{d.kind.value} rank {d.rank_id}" for d in decisions if d.kind in
                                   (DecisionKind.DERATE, DecisionKind.RESTORE)]
                                  or ["weights again after an epoch change"])
            self.placing.start(key, len(c.members), plan_rebalance, c.location, self.load(), list(c.members),
                               c.rank_nodes(), self.placement_speeds(), 1.0)
        done = self.placing.take(key)
        if done is None:
            return False
        plan = done.value
        if plan is not None:
            self.form(Reweight(plan.placement), f"straggler: {self._why}; imbalance in time "
                      f"{plan.before:.2f} -> {plan.after:.2f}")
        self._placed = (c.epoch, weights)  # the epoch it formed
        return plan is not None

    def _announce(self, d: Decision) -> None:
        c = self.cluster
        hardware = self.evidence(c.ranks[d.rank_id].node) if d.rank_id in c.ranks else None
        c.events.add(EventKind.STRAGGLER, d.reason, d.rank_id, decision=d.kind.value, speed=round(d.speed, 3),
                     evidence=d.evidence, hardware=hardware)

    def view(self, now: float) -> dict[str, Any]:
        """The policy and its state, for /cluster."""
        return {**self.policy.to_json(), **self.state.to_json(now)}
