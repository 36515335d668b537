"""The background rebalance's target computed off the control thread from OFF_THREAD_RANKS members
on: no move is due while it is computed, the first move goes to it once it is there, and the walk
ends judged against the placement from scratch computed with it; a smaller group computes it at once."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
from control_standins import cluster_of, config
from prometheus_client import CollectorRegistry

from elastic_ep.control.epochs.background_rebalance import OFF_THREAD_RANKS, BackgroundRebalance
from elastic_ep.control.epochs.rebalance_rules import rebalance_targets
from elastic_ep.control.epochs.requests import Move
from elastic_ep.control.events import EventKind
from elastic_ep.control.metrics import ClusterMetrics
from elastic_ep.placement.fault_aware import fault_aware_placement

EXPERTS, SLOTS = 24, 4


class Rig:
    """`ranks` members on nodes of 4, placed for one load; the walk is asked for another."""

    def __init__(self, ranks: int):
        nodes = {r: f"n{r // 4}" for r in range(ranks)}
        self.cluster = c = cluster_of(nodes, experts=EXPERTS, slots=SLOTS)
        rng = np.random.default_rng(ranks)
        c.location = fault_aware_placement(rng.random((1, EXPERTS)), c.members, nodes, None, SLOTS, ranks)
        self.load = rng.random((1, EXPERTS)) * 100
        self.formed: list[Move] = []
        self.jobs: list[tuple[object, tuple, cf.Future]] = []
        self.rebalance = BackgroundRebalance(
            c, config(ep_size=ranks, rebalance_move_bytes=1 << 40), 1, ClusterMetrics(CollectorRegistry()),
            load=lambda: self.load, load_steps=lambda: 0, speeds=lambda: None, form=self._form,
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
