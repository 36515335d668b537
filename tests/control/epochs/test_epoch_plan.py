"""A new epoch's plan per rank: restarted ranks and suspect slots hold nothing; every rank
receives what it lacks and the senders send it in the receiver's order."""

from __future__ import annotations

from elastic_ep.control.epochs.epoch_plan import held_placement, split_by_rank
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.placement.transfer import plan_transfers

# 2 layers, 4 experts, 3 ranks x 2 slots.
CURRENT = ExpertLocation.from_phy2log([[0, 1, 2, 3, 0, 2], [3, 2, 1, 0, 1, 3]], 2, 4)


def test_held_placement_empties_non_holders_and_suspect_slots():
    held = held_placement(CURRENT, 2, 4, 2, 3, holders=[0, 2], suspect_slots=[(2, 1, 0)])
    assert held.phy2log.tolist() == [[0, 1, -1, -1, 0, 2], [3, 2, -1, -1, -1, 3]]


def test_split_by_rank_matches_senders_to_receivers():
    old = held_placement(CURRENT, 2, 4, 2, 3, holders=[0, 2])
    new = ExpertLocation.from_phy2log([[0, 1, -1, -1, 2, 3], [3, 0, -1, -1, 1, 2]], 2, 4)
    plan = plan_transfers(old, new, [0, 2], {0: "a", 2: "a"}, {(0, 3): "a"}, expert_nbytes=8)
    sources, sends = split_by_rank(plan, 2)
    summary = {
        rank: {(s.layer, s.slot): (s.expert, s.kind, s.src_rank, s.src_slot) for s in items}
        for rank, items in sources.items()
    }
    assert summary == {
        0: {(1, 1): (0, "disk", -1, -1)},
        2: {(0, 0): (2, "local", 2, 1), (0, 1): (3, "backup", -1, -1), (1, 1): (2, "peer", 0, 1)},
    }
    assert sends == {0: [(2, 1, 1)]}
