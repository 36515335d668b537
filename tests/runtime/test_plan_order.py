"""A worker's plan rules (runtime/plan_order.py), for plans that come on two paths (the step socket
and the agent's relay) that are not ordered with each other."""

from elastic_ep.runtime.plan_order import MAX_HELD_PLANS, PlanOrder, Verdict
from elastic_ep.wire import StepPlan


def plan(epoch: int, step: int) -> StepPlan:
    return StepPlan(epoch, step, [], [])


def test_a_plan_of_the_current_epoch_runs_once_and_never_after_a_later_one():
    order = PlanOrder()
    first = plan(1, 10)
    assert order.admit(first, 1) == Verdict.RUN
    order.ran(first)
    assert order.admit(plan(1, 10), 1) == Verdict.DROP  # the same plan again (relayed twice)
    assert order.admit(plan(1, 11), 1) == Verdict.RUN
    order.ran(plan(1, 11))
    assert order.admit(plan(1, 10), 1) == Verdict.DROP  # out of order: an older step comes late


def test_a_plan_ahead_of_its_epoch_start_is_held_then_released_in_step_order():
    order = PlanOrder()
    assert order.admit(plan(3, 21), 2) == Verdict.HOLD
    assert order.admit(plan(3, 20), 2) == Verdict.HOLD
    assert order.admit(plan(3, 20), 2) == Verdict.HOLD  # held once
    assert [(p.epoch, p.step) for p in order.release(3)] == [(3, 20), (3, 21)]
    assert order.release(3) == []


def test_plans_of_older_epochs_are_dropped_held_or_arriving():
    order = PlanOrder()
    assert order.admit(plan(4, 30), 2) == Verdict.HOLD
    assert order.admit(plan(1, 9), 2) == Verdict.DROP  # the rank is in epoch 2 already
    assert order.release(5) == []  # the rank went straight to epoch 5: epoch 4's plan is gone
    assert order.held == []


def test_a_step_answered_not_run_never_runs_when_its_plan_comes_late():
    """The rank told the controller it never got (2, 15)'s plan; a stalled agent then relays it: it must
    not run (the controller recomputes the step in a new epoch), held or not."""
    order = PlanOrder()
    order.passed(2, 15)
    assert order.admit(plan(2, 15), 2) == Verdict.DROP
    assert order.admit(plan(2, 16), 2) == Verdict.RUN
    ahead = PlanOrder()  # held before its epoch started, then asked for
    assert ahead.admit(plan(3, 15), 2) == Verdict.HOLD
    ahead.passed(3, 15)
    assert ahead.release(3) == []


def test_the_held_plans_are_bounded_keeping_the_newest():
    order = PlanOrder()
    for step in range(MAX_HELD_PLANS + 3):
        assert order.admit(plan(9, step), 8) == Verdict.HOLD
    assert [p.step for p in order.release(9)] == list(range(3, MAX_HELD_PLANS + 3))


def test_a_new_leader_numbers_afresh():
    order = PlanOrder()
    order.ran(plan(7, 500))
    order.admit(plan(8, 501), 7)
    order.reset()
    assert order.admit(plan(0, 1), 0) == Verdict.RUN and order.held == []
