"""A node's step results gathered by its agent (node/step_gather.py): a step's results go as one
batch as soon as every rank expected answered; a slow rank holds the others back for the gather
window only, and its own result follows alone; a rank that never answers never holds a step."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_ep.node.step_gather import StepGather
from elastic_ep.wire import StepResult

WINDOW_S = 0.002
RANKS = [0, 1, 2, 3]


def result(rank_id: int, step: int, epoch: int = 1) -> StepResult:
    return StepResult(epoch, step, rank_id, {rank_id: 7}, 0.02, 0.02, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {})


def ranks_of(batches: list[list[StepResult]]) -> list[list[int]]:
    return [sorted(r.rank_id for r in batch) for batch in batches]


def gather_after_one_step() -> StepGather:
    """Step 0 of epoch 1 answered by every rank: from then on all four are expected."""
    gather = StepGather(WINDOW_S)
    for r in RANKS:
        gather.add(result(r, 0), 0.0)
    assert ranks_of(gather.due(0.0, RANKS)) == [RANKS]
    return gather


def test_a_step_goes_as_one_batch_once_all_its_ranks_answered():
    gather = gather_after_one_step()
    for r in RANKS[:3]:
        gather.add(result(r, 1), 1.0)
        assert gather.due(1.0, RANKS) == []  # rank 3 is still to come, within the window
    gather.add(result(3, 1), 1.0005)
    assert ranks_of(gather.due(1.0005, RANKS)) == [RANKS]  # the last one completes it: nothing waits
    assert gather.next_due_s(1.0005) is None


def test_a_slow_rank_holds_the_others_for_the_window_then_follows_alone():
    gather = gather_after_one_step()
    for r in RANKS[:3]:
        gather.add(result(r, 1), 1.0)
    assert gather.next_due_s(1.0) == pytest.approx(WINDOW_S)
    assert ranks_of(gather.due(1.0 + WINDOW_S, RANKS)) == [[0, 1, 2]]  # forwarded partial
    gather.add(result(3, 1), 1.05)
    assert ranks_of(gather.due(1.05, RANKS)) == [[3]]  # alone, at once: the others already went


def test_a_rank_that_never_answers_costs_one_window_then_once_gone_is_not_awaited():
    gather = gather_after_one_step()
    for r in RANKS[:3]:
        gather.add(result(r, 1), 1.0)
    assert ranks_of(gather.due(1.0 + WINDOW_S, RANKS)) == [[0, 1, 2]]  # rank 3 stopped: the rest go
    for r in RANKS[:3]:  # rank 3 is gone from the node's running ranks: its node's steps wait for no one
        gather.add(result(r, 2), 2.0)
    assert ranks_of(gather.due(2.0, RANKS[:3])) == [[0, 1, 2]]


def test_an_epochs_first_results_go_one_by_one_and_ranks_of_another_epoch_are_not_awaited():
    gather = gather_after_one_step()
    gather.add(result(2, 0, epoch=2), 3.0)  # a new epoch: the others' last results are of epoch 1
    assert ranks_of(gather.due(3.0, RANKS)) == [[2]]
    gather.add(result(0, 0, epoch=2), 3.001)
    assert ranks_of(gather.due(3.001, RANKS)) == [[0]]
