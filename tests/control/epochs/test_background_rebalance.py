"""The background rebalance's target and EPLB's plan computed off the control thread from
OFF_THREAD_RANKS members on: no move is due while the target is computed, the first move goes to it
once it is there, and the walk ends judged against the placement from scratch computed with it;
EPLB's plan starts its walk at the first boundary after it is there, unless the epoch changed; a
smaller group computes both at once."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
from control_standins import cluster_of, config
from prometheus_client import CollectorRegistry

from elastic_ep.control.epochs.background_rebalance import BackgroundRebalance
from elastic_ep.control.epochs.off_thread import OFF_THREAD_RANKS
from elastic_ep.control.epochs.rebalance_rules import eplb_plan, rebalance_targets
from elastic_ep.control.epochs.requests import Move
from elastic_ep.control.events import EventKind
from elastic_ep.control.metrics import ClusterMetrics
from elastic_ep.placement.fault_aware import fault_aware_placement

EXPERTS, SLOTS = 24, 4


class Rig:
    """`ranks` members on nodes of 4, placed for one load; the walk is asked for another."""

    def __init__(self, ranks: int, **flags):
        nodes = {r: f"n{r // 4}" for r in range(ranks)}
        self.cluster = c = cluster_of(nodes, experts=EXPERTS, slots=SLOTS)
        rng = np.random.default_rng(ranks)
        c.location = fault_aware_placement(rng.random((1, EXPERTS)), c.members, nodes, None, SLOTS, ranks)
        self.load = rng.random((1, EXPERTS)) * 100
        self.formed: list[Move] = []
        self.jobs: list[tuple[object, tuple, cf.Future]] = []
        self.rebalance = BackgroundRebalance(
            c, config(ep_size=ranks, rebalance_move_bytes=1 << 40, **flags), 1, ClusterMetrics(CollectorRegistry()),
            load=lambda: self.load, load_steps=lambda: 1 << 20, speeds=lambda: None, form=self._form,
            scaling=lambda: False, has_work=lambda: False, recovering=lambda: False, compute=self._compute)

    def _compute(self, fn, *args) -> cf.Future:
        future: cf.Future = cf.Future()
        self.jobs.append((fn, args, future))
        return future

    def _form(self, request: Move, reason: str):
        self.formed.append(request)
        self.cluster.location = request.target
        self.cluster.epoch += 1


def test_a_large_groups_target_is_computed_off_the_control_thread_and_no_move_waits_on_this_thread():
    rig = Rig(OFF_THREAD_RANKS)
    rig.rebalance.request("a rank rejoined")
    assert rig.rebalance.due()
    rig.rebalance.advance()  # starts the computation, moves nothing
    assert rig.formed == [] and len(rig.jobs) == 1 and rig.jobs[0][0] is rebalance_targets
    assert not rig.rebalance.due()  # the loop runs steps meanwhile
    fn, args, future = rig.jobs[0]
    target, scratch = fn(*args)
    future.set_result((target, scratch))
    assert rig.rebalance.due()
    rig.rebalance.advance()  # every slot fits in one move (--rebalance-move-bytes): the target at once
    assert [m.target for m in rig.formed] == [target] and len(rig.jobs) == 1
    done = [e for e in rig.cluster.events.all() if e["kind"] == EventKind.REBALANCED.value]
    assert len(done) == 1 and rig.rebalance.reason is None and rig.rebalance.scratch is None


def test_a_cancelled_walk_drops_its_computation_and_a_small_group_computes_at_once():
    rig = Rig(OFF_THREAD_RANKS)
    rig.rebalance.request("a rank rejoined")
    rig.rebalance.advance()
    rig.rebalance.cancel()  # a fault: the recovery asks for a new walk over the survivors
    rig.jobs[0][2].set_result(rebalance_targets(*rig.jobs[0][1]))
    assert not rig.rebalance.due() and rig.formed == []
    small = Rig(OFF_THREAD_RANKS // 2)
    small.rebalance.request("a rank rejoined")
    small.rebalance.advance()
    assert small.jobs == [] and len(small.formed) == 1


def test_eplbs_plan_is_computed_off_the_control_thread_and_dropped_when_the_epoch_changed():
    rig = Rig(OFF_THREAD_RANKS, enable_eplb=True, eplb_interval=10, eplb_threshold=1.0)
    c = rig.cluster
    c.step = 10
    rig.rebalance.check_eplb()  # due: its check goes off the thread, no walk yet
    assert len(rig.jobs) == 1 and rig.jobs[0][0] is eplb_plan and rig.rebalance.reason is None
    c.step = 11
    rig.rebalance.check_eplb()  # not asked again while it is computed
    assert len(rig.jobs) == 1 and rig.rebalance.reason is None
    fn, args, future = rig.jobs[0]
    plan, scratch = fn(*args)
    assert plan is not None  # a random placement for another load: uneven enough at threshold 1.0
    future.set_result((plan, scratch))
    rig.rebalance.check_eplb()  # there: the walk starts to it, judged against its scratch under its load
    assert rig.rebalance.reason.startswith("eplb") and rig.rebalance.target is plan.placement
    assert rig.rebalance.scratch is scratch and rig.rebalance.target_load is args[1]
    rig.rebalance.advance()
    assert [m.target for m in rig.formed] == [plan.placement]
    assert [e for e in c.events.all() if e["kind"] == EventKind.REBALANCED.value]

    c.step = 20
    rig.rebalance.check_eplb()
    assert len(rig.jobs) == 2
    c.epoch += 1  # a fault's recovery formed another epoch meanwhile: its plan is for a placement gone
    rig.jobs[1][2].set_result(eplb_plan(*rig.jobs[1][1]))
    c.step = 21
    rig.rebalance.check_eplb()
    assert rig.rebalance.reason is None and len(rig.formed) == 1


def test_a_small_groups_eplb_check_runs_at_once():
    rig = Rig(OFF_THREAD_RANKS // 2, enable_eplb=True, eplb_interval=10, eplb_threshold=1.0)
    rig.cluster.step = 10
    rig.rebalance.check_eplb()
    assert rig.jobs == [] and rig.rebalance.reason.startswith("eplb")
