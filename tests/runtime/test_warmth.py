"""What a rank warms after an epoch change (runtime/warmth.py): the slots the epoch filled and
any occupied slot not warm yet, never a slot kept warm from an earlier epoch; and running them
(`ExpertSlots.run_each`) computes exactly those."""

from __future__ import annotations

import numpy as np
import torch

from elastic_ep.runtime.experts import ExpertSlots
from elastic_ep.runtime.warmth import slots_to_warm


def test_the_first_epoch_warms_every_occupied_slot():
    occupied = np.array([[True, True, False], [True, True, True]])
    cold = slots_to_warm(np.zeros_like(occupied), occupied, [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)])
    assert (cold == occupied).all()


def test_a_later_epoch_warms_only_the_slots_it_filled():
    occupied = np.ones((2, 3), dtype=bool)
    cold = slots_to_warm(occupied.copy(), occupied, [(1, 2), (0, 0)])
    assert sorted(zip(*np.nonzero(cold), strict=True)) == [(0, 0), (1, 2)]
    assert not slots_to_warm(occupied.copy(), occupied, []).any()  # nothing filled: nothing to run


def test_a_filled_slot_is_warmed_even_where_it_was_warm_and_a_cold_one_even_where_not_filled():
    warmed = np.array([[True, False, True]])  # slot 1 lost its warmth (a sleep dropped it)
    occupied = np.array([[True, True, False]])  # slot 2 emptied
    cold = slots_to_warm(warmed, occupied, [(0, 0)])
    assert cold.tolist() == [[True, True, False]]


def test_running_the_cold_slots_computes_each_once():
    slots = ExpertSlots([1, 2], slots_per_rank=3, inter=4, hidden=8)
    torch.manual_seed(0)
    for w in slots.w13 + slots.w2:
        w.normal_()
    cold = np.array([[False, True, True], [True, False, False]])
    assert slots.run_each(cold) == 3
    assert slots.run_each(np.zeros((2, 3), dtype=bool)) == 0
