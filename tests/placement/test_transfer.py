from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ep.errors import PlacementError
from elastic_ep.placement import ExpertLocation, plan_transfers
from elastic_ep.placement.transfer import _slots_of

NODES = {0: "a", 1: "a", 2: "b", 3: "b"}


def loc(row, slots=2):
    return ExpertLocation.from_phy2log([row], slots_per_rank=slots, num_experts=6)


def sources(plan):
    return {(t.dst_slot, t.expert): (t.source, t.src_rank) for t in plan.transfers}


def test_each_slot_takes_the_cheapest_source():
    # old: rank0 [0,1] rank1 [2,3] rank2 [4,5] rank3 dead [5,0]
    old = loc([0, 1, 2, 3, 4, 5, 5, 0])
    # new: rank 0 keeps 0 and takes 2 (a peer on its node); rank 1 swaps its slots (local copies);
    # rank 2 moves 5 to its first slot (local) and takes 1 (peer, from the other node)
    new = loc([0, 2, 3, 2, 5, 1, -1, -1])
    plan = plan_transfers(old, new, [0, 1, 2], NODES, None, expert_nbytes=100)
    got = sources(plan)
    assert got[(0, 0)] == ("keep", 0)
    assert got[(1, 2)] == ("peer", 1)  # rank 1 is on rank 0's node
    assert got[(2, 3)] == ("local", 1)
    assert got[(3, 2)] == ("local", 1)
    assert got[(4, 5)] == ("local", 2)
    assert got[(5, 1)] == ("peer", 0)
    assert plan.bytes_by_source == {"keep": 100, "local": 300, "peer": 200, "backup": 0, "disk": 0}
    assert plan.bytes_moved == 200
    assert len(plan.moves()) == 5


def test_lost_experts_come_from_backup_else_disk_never_from_the_dead_rank():
    old = loc([0, 1, 2, 3, 4, 5, 4, -1])
    new = loc([4, 1, 2, 3, -1, -1, 0, 5])
    # rank 2 died holding the only copy of expert 5
    plan = plan_transfers(old, new, [0, 1, 3], NODES, {(0, 5): "b"}, expert_nbytes=1)
    got = sources(plan)
    assert got[(0, 4)] == ("peer", 3)
    assert got[(6, 0)] == ("peer", 0)
    assert got[(7, 5)] == ("backup", -1)
    without_backup = plan_transfers(old, new, [0, 1, 3], NODES, None, expert_nbytes=1)
    assert sources(without_backup)[(7, 5)] == ("disk", -1)
    assert without_backup.bytes_by_source["disk"] == 1 and plan.bytes_by_source["backup"] == 1


def test_copies_of_one_expert_are_spread_over_its_holders():
    old = ExpertLocation.from_phy2log([[0, 0, 1, 2, 3, 4, 5, -1]], slots_per_rank=1, num_experts=6)
    # expert 0 is on ranks 0 and 1; ranks 2..7 each need a copy of it
    new = ExpertLocation.from_phy2log([[0, 0, 0, 0, 0, 0, 0, 0]], slots_per_rank=1, num_experts=6)
    nodes = dict.fromkeys(range(8), "n")
    plan = plan_transfers(old, new, range(8), nodes, None, expert_nbytes=1)
    senders = Counter(t.src_rank for t in plan.transfers if t.source == "peer")
    assert senders == {0: 3, 1: 3}


def test_new_placement_on_a_dead_rank_is_refused():
    old = loc([0, 1, 2, 3, 4, 5, -1, -1])
    with pytest.raises(PlacementError, match="not live"):
        plan_transfers(old, old, [0, 1], NODES, None, expert_nbytes=1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-1, 5), min_size=1, max_size=24), st.lists(st.integers(0, 5), max_size=4))
def test_a_layers_slots_of_experts_are_log2phys_rows(row, experts):
    """The transfer plan reads the slots of the experts it moves from phy2log, not log2phy: the same slots."""
    p = np.array([row])
    loc = ExpertLocation.from_phy2log(p, 1, 6)
    got = _slots_of(p[0], np.array(experts, dtype=np.int64))
    assert set(got) <= set(experts)
    for expert in experts:
        assert got.get(expert, []) == [int(s) for s in loc.log2phy[0, expert] if s >= 0]
