"""Poison isolation as a pure decision loop: steps are simulated from which sequences run on
which rank and which of them break a step; the loop must end exactly the culprits, within its
bound, and name a rank that fails with nothing to blame."""

from __future__ import annotations

import pytest

from elastic_ep.control.events import EventLog
from elastic_ep.control.serving.isolation import Isolation
from elastic_ep.control.serving.scheduler import StepBatch
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.wire import ChunkPlan, StepErrorKind, StepFailed


class Ended:
    """Stands in for the request streams: records which sequences were ended and why."""

    def __init__(self):
        self.errors: dict[int, str] = {}

    def end_with_error(self, seq_id: int, error: str) -> None:
        self.errors[seq_id] = error


def simulate(placement: dict[int, int], poisoned: set[int], broken_rank: int | None = None,
             in_experts: bool = False, max_steps: int = 24, steps: int = 60):
    """Run `steps` steps; a step fails on a rank that runs a poisoned sequence (or is broken)."""
    ended, faults = Ended(), []
    iso = Isolation(ended, EventLog(), faults.append, max_steps)
    alive = set(placement)
    for step in range(steps):
        running = alive - iso.held - set(ended.errors)
        chunks = {r: [] for r in set(placement.values())}
        for seq in sorted(running):
            chunks[placement[seq]].append(ChunkPlan(seq, [1], 0, True, SamplingParams(), 0, 1))
        batch = StepBatch(chunks, {})
        failing = {r for r, cs in chunks.items() if r == broken_rank or any(c.seq_id in poisoned for c in cs)}
        if failing:
            failures = {r: StepFailed(0, step, r, "boom", StepErrorKind.LOCAL, in_experts) for r in failing}
            iso.step_failed(step, batch, failures)
        else:
            iso.step_passed(batch)
        if faults:
            break
    return ended.errors, faults, iso


PLACEMENT = {seq: seq % 4 for seq in range(24)}  # 24 sequences on 4 ranks


@pytest.mark.parametrize("culprit", [0, 5, 23])
@pytest.mark.parametrize("in_experts", [False, True])
def test_one_poisoned_request_is_the_only_one_ended(culprit, in_experts):
    errors, faults, iso = simulate(PLACEMENT, {culprit}, in_experts=in_experts)
    assert set(errors) == {culprit} and "made step" in errors[culprit] and "boom" in errors[culprit]
    assert not faults and not iso.suspects and iso.isolated == 1


def test_two_poisoned_requests_on_different_ranks_are_both_found():
    errors, faults, _ = simulate(PLACEMENT, {6, 13})
    assert set(errors) == {6, 13} and not faults


def test_a_rank_that_fails_every_step_is_a_fault_and_no_request_is_ended():
    errors, faults, iso = simulate(PLACEMENT, set(), broken_rank=2)
    assert not errors
    assert [f.rank_id for f in faults] == [2] and faults[0].cause.value == "step_errors"
    assert not iso.suspects


def test_the_round_is_bounded():
    errors, faults, _ = simulate(PLACEMENT, {1}, max_steps=2)
    # too few steps to find the culprit: its suspects end with an error that says so
    assert 1 in errors and all("could not be cleared" in e or "made step" in e for e in errors.values())
    assert len(errors) < len(PLACEMENT)
