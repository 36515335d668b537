"""The server's straggler role (control/faults/straggler_control.py, built here with stand-ins for
what it asks of the loop, and real cluster state, recorder and placement) and the simulator's replay
(sim/straggler_episode.py) apply the same policy to the same per-rank timings: the same
decisions, for the same ranks, within one review interval of each other."""

import concurrent.futures as cf

import numpy as np
import pytest

from elastic_ep.control.cluster import ClusterState
from elastic_ep.control.config import ServeConfig
from elastic_ep.control.epochs.rebalance_rules import plan_rebalance
from elastic_ep.control.epochs.requests import Reweight
from elastic_ep.control.faults.straggler_control import StragglerControl
from elastic_ep.control.ranks import RankInfo
from elastic_ep.placement.fault_aware import fault_aware_placement
from elastic_ep.policy.straggler_policy import DecisionKind
from elastic_ep.policy.straggler_verdict import IntervalRecorder
from elastic_ep.sim.straggler_episode import STEP_TOKENS, replay

RANKS, STEP_S = [0, 1, 2, 3], 0.05
LAYERS, EXPERTS, SLOTS = 2, 8, 3


class StandIn:
    """What StragglerControl is built with; a fault leaves the group as recovery would."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.cluster = ClusterState(LAYERS, EXPERTS, SLOTS)
        for r in RANKS:
            self.cluster.ranks[r] = RankInfo(r, f"n{r}")
        self.cluster.members, self.cluster.epoch = list(RANKS), 0
        self.cluster.location = fault_aware_placement(np.ones((LAYERS, EXPERTS)), RANKS, self.cluster.rank_nodes(),
                                                      None, SLOTS, len(RANKS))
        self.own_time = IntervalRecorder(cfg.straggler_window_s)
        self.epochs: list[str] = []
        self.recovering = False

    def fault(self, fault) -> None:
        self.cluster.members.remove(fault.rank_id)

    def load(self):
        return np.ones((LAYERS, EXPERTS))

    def form(self, request: Reweight, reason: str):
        self.cluster.epoch += 1
        self.cluster.location = request.target
        self.epochs.append(reason)

    def role(self, compute=None) -> StragglerControl:
        return StragglerControl(self.cluster, self.cfg, self.own_time, standbys=lambda: 0, fault=self.fault,
                                replace_later=lambda r: None, pending=lambda: False,
                                evidence=lambda node: f"node {node}: no hardware report yet", load=self.load,
                                form=self.form, recovering=lambda: self.recovering, compute=compute)


def judged_and_reviewed(control: StragglerControl, t: float) -> bool:
    """A boundary of an idle loop, which judges and then reviews (the controller's `_housekeep`)."""
    control.judge(t)
    return control.review(t)


def server_decisions(cfg: ServeConfig, own_ms, duration_s: float):
    """Steps of every member every STEP_S, the role reviewing after each what the step's wait judged
    (the controller's order: a verdict is acted on a step after it); -> (time, kind, rank) of
    its straggler events (timed by the step they came at) and the stand-in."""
    ctl = StandIn(cfg)
    control = ctl.role()
    out, t = [], 0.0
    while t < duration_s:
        t += STEP_S
        for r in list(ctl.cluster.members):
            ctl.own_time.add(t, r, STEP_TOKENS, own_ms(r, t) / 1000)
        seen = len(ctl.cluster.events.all())
        control.review(t)  # the boundary acts on what the last step's wait judged
        control.judge(t)  # the next step's wait
        out += [(t, DecisionKind(e["decision"]), e["rank_id"]) for e in ctl.cluster.events.all()[seen:]
                if e["kind"] == "straggler"]
    return out, ctl


@pytest.mark.parametrize("flags, slow_until_s, expected", [
    ({"straggler_policy": "evict", "straggler_evict_after_s": 8.0}, 60.0, [DecisionKind.DERATE, DecisionKind.EVICT]),
    ({"straggler_policy": "derate", "straggler_clear_after_s": 3.0}, 18.0,
     [DecisionKind.DERATE, DecisionKind.RESTORE]),
])
def test_server_and_simulator_decide_the_same_on_the_same_timings(flags, slow_until_s, expected):
    cfg = ServeConfig("unused", "unused", 4, **flags)
    rule, policy = cfg.straggler_rule(), cfg.straggler_policy_params()

    def own_ms(r: int, t: float) -> float:
        return 60.0 if r == 2 and 10.0 < t < slow_until_s else 20.0

    server, ctl = server_decisions(cfg, own_ms, 40.0)
    sim = [(t, d.kind, d.rank_id) for t, d in replay(own_ms, RANKS, STEP_S, 40.0, rule, policy, ctl.cluster.min_ranks)]

    assert [(k, r) for _, k, r in server] == [(k, 2) for k in expected]
    assert [(k, r) for _, k, r in sim] == [(k, r) for _, k, r in server]
    for (ts, _, _), (tm, _, _) in zip(server, sim, strict=True):
        assert abs(ts - tm) <= rule.window_s / 10 + STEP_S
    if DecisionKind.EVICT in expected:
        assert 2 not in ctl.cluster.members
    assert ctl.epochs and ctl.epochs[0].startswith("straggler: derate rank 2")


def test_weights_again_after_a_recovery_wait_for_its_first_step():
    """A derated rank's weights are applied again after an epoch made elsewhere, but not in a
    recovery's pause: before its first step that epoch doubled the pause at 1,024 stand-in ranks
    (BENCHMARKS, "Kill and stop at 1,024")."""
    cfg = ServeConfig("unused", "unused", 4, straggler_policy="derate", straggler_clear_after_s=1000.0)
    ctl = StandIn(cfg)
    control = ctl.role()
    unweighted = ctl.cluster.location
    t = 0.0
    while not ctl.epochs and t < 40.0:  # rank 2 at 3x its peers' time until derated
        t += STEP_S
        for r in RANKS:
            ctl.own_time.add(t, r, STEP_TOKENS, (60.0 if r == 2 else 20.0) / 1000)
        judged_and_reviewed(control, t)
    assert ctl.epochs and ctl.epochs[0].startswith("straggler: derate rank 2")
    ctl.cluster.epoch, ctl.cluster.location = ctl.cluster.epoch + 1, unweighted  # a recovery's, without weights
    ctl.recovering = True
    for _ in range(3):
        t += control.interval_s
        assert not judged_and_reviewed(control, t)
    assert len(ctl.epochs) == 1
    ctl.recovering = False  # its first step completed
    t += control.interval_s
    assert judged_and_reviewed(control, t)
    assert ctl.epochs[1].startswith("straggler: weights again after an epoch change")


def test_a_large_groups_weighted_placement_is_computed_off_the_thread_and_formed_at_the_next_boundary():
    """From OFF_THREAD_RANKS members (here from 0) the derate's placement goes to the worker: no
    epoch while it computes, and the first boundary after it is there forms it, not the next review."""
    cfg = ServeConfig("unused", "unused", 4, straggler_policy="derate", straggler_clear_after_s=1000.0)
    ctl = StandIn(cfg)
    jobs: list[tuple[object, tuple, cf.Future]] = []

    def submit(fn, *args) -> cf.Future:
        jobs.append((fn, args, cf.Future()))
        return jobs[-1][2]

    control = ctl.role(compute=submit)
    control.placing.min_ranks = 0
    t = 0.0
    while not jobs and t < 40.0:  # rank 2 at 3x its peers' time until derated
        t += STEP_S
        for r in RANKS:
            ctl.own_time.add(t, r, STEP_TOKENS, (60.0 if r == 2 else 20.0) / 1000)
        assert not judged_and_reviewed(control, t)
    assert len(jobs) == 1 and jobs[0][0] is plan_rebalance and ctl.epochs == []
    t += STEP_S
    assert not judged_and_reviewed(control, t)  # still computed: the loop steps on
    fn, args, future = jobs[0]
    future.set_result(fn(*args))
    t += STEP_S  # within the same review interval
    assert judged_and_reviewed(control, t) and len(jobs) == 1
    assert len(ctl.epochs) == 1 and ctl.epochs[0].startswith("straggler: derate rank 2")
    t += control.interval_s
    assert not judged_and_reviewed(control, t) and len(jobs) == 1  # placed: not asked again


def test_verdicts_judged_in_an_epoch_gone_by_are_not_acted_on():
    """The verdicts judged in a step's wait are acted on at the next boundary, unless an epoch formed
    in between (a recovery, a rejoin): its members were judged on another group's timings."""
    cfg = ServeConfig("unused", "unused", 4, straggler_policy="derate", straggler_clear_after_s=1000.0)
    ctl = StandIn(cfg)
    control = ctl.role()
    t = 0.0
    while not ctl.epochs and t < 40.0:  # rank 2 at 3x its peers' time, judged but never reviewed in time
        t += STEP_S
        for r in RANKS:
            ctl.own_time.add(t, r, STEP_TOKENS, (60.0 if r == 2 else 20.0) / 1000)
        control.judge(t)
        ctl.cluster.epoch += 1  # an epoch forms before each boundary
        assert not control.review(t)
    assert ctl.epochs == [] and not control.derated()
    control.judge(t + control.interval_s)  # the same timings, judged and acted on in one epoch
    assert control.review(t + control.interval_s)
    assert ctl.epochs[0].startswith("straggler: derate rank 2")
