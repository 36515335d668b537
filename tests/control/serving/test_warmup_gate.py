"""The readiness gate after an epoch change (control/serving/warmup.py): the group's forwards run
only the shapes a member has not run (none after a loss, every one when a new process joins),
and the epoch serves only once every rank ran each slot it filled."""

from __future__ import annotations

from control_standins import Plane, cluster_of

from elastic_ep.control.serving.warmup import WarmUpGate, steps_to_warm
from elastic_ep.wire import EpochReady, WarmUp

STEPS = [(1, 1), (2, 1), (4, 1)]


def ready(rank_id: int, slots_warmed: int, steps_run: list[tuple[int, int]]) -> EpochReady:
    return EpochReady(1, rank_id, {}, {}, [], 0.0, 0.0, 0.0, slots_warmed, 0.001, steps_run)


def gate_of(cluster, plane) -> WarmUpGate:
    return WarmUpGate(cluster, plane, [1, 2, 4], 1.0, lambda timeout_s: None, lambda ranks: False)


def test_the_steps_to_warm_are_those_some_member_has_not_run():
    assert steps_to_warm(STEPS, [set(STEPS), set(STEPS)]) == []
    assert steps_to_warm(STEPS, [set(STEPS), {(1, 1)}]) == [(2, 1), (4, 1)]
    assert steps_to_warm(STEPS, [set(STEPS), set()]) == STEPS  # a new process: every shape, on every member
    assert steps_to_warm(STEPS, []) == []


def test_after_a_loss_no_forward_runs_and_the_filled_slots_are_counted():
    cluster, plane = cluster_of({0: "n0", 1: "n0", 2: "n1"}), Plane()
    cluster.epoch = 1
    gate = gate_of(cluster, plane)
    report = gate.run({r: ready(r, 3 if r == 2 else 0, STEPS) for r in (0, 1, 2)}, {2: 3})
    assert report.complete and report.shapes == [] and not plane.sent(WarmUp), report
    assert (report.slots_filled, report.filled_slots_warmed) == (3, 3)
    assert gate.epoch == 1


def test_a_rank_that_did_not_run_every_slot_it_filled_fails_the_warm_up():
    cluster, plane = cluster_of({0: "n0", 1: "n0"}), Plane()
    cluster.epoch = 1
    gate = gate_of(cluster, plane)
    report = gate.run({0: ready(0, 1, STEPS), 1: ready(1, 0, STEPS)}, {0: 2})
    assert not report.complete and "rank 0: ran 1 of the 2 slots it filled" in report.problem
    assert gate.epoch == -1  # the epoch does not serve


def test_a_new_process_makes_the_group_run_the_shapes_it_lacks_and_the_old_rule_runs_all():
    cluster, plane = cluster_of({0: "n0", 1: "n0"}), Plane()
    cluster.epoch = 1
    gate = gate_of(cluster, plane)
    gate.pump = lambda timeout_s: None
    gate.faulted = lambda ranks: True  # the test stops at the forwards sent
    gate.run({0: ready(0, 0, STEPS), 1: ready(1, 4, [(1, 1)])}, {1: 4})
    assert [(m.shapes, m.micro_batches) for m in plane.sent(WarmUp)] == [([2, 4], [1, 1])] * 2
    plane.to_workers.clear()
    gate.every_step = True
    gate.run({0: ready(0, 0, STEPS), 1: ready(1, 0, STEPS)}, {})
    assert [m.shapes for m in plane.sent(WarmUp)] == [[1, 2, 4]] * 2
