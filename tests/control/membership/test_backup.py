"""Which node backs up which expert (control/membership/backup_shares.py)."""

import numpy as np

from elastic_ep.control.membership.backup_shares import backup_shares
from elastic_ep.placement.location import ExpertLocation


def location(rows: list[list[int]], slots_per_rank: int, num_experts: int) -> ExpertLocation:
    """One MoE layer; rows: the experts of each rank's slots."""
    return ExpertLocation.from_phy2log(np.array([sum(rows, [])]), slots_per_rank, num_experts)


def replica_nodes(loc: ExpertLocation, rank_nodes: dict[int, str], expert: int) -> set[str]:
    slots = loc.log2phy[0, expert, : loc.logcnt[0, expert]]
    return {rank_nodes[loc.rank_of_slot(int(p))] for p in slots}


def test_a_backup_avoids_every_node_with_a_replica_and_the_nodes_share_the_bytes():
    # ranks 0 and 1 on node a hold every expert's first copy; b and c each hold half the second copies
    loc = location([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]], 4, 8)
    rank_nodes = {0: "a", 1: "a", 2: "b", 3: "c"}
    shares = backup_shares(loc, rank_nodes, ["a", "b", "c"])
    assert sorted(e for items in shares.values() for _, e in items) == list(range(8))  # each expert once
    for node, items in shares.items():
        for _, expert in items:
            assert node not in replica_nodes(loc, rank_nodes, expert)
    assert [len(shares[n]) for n in "abc"] == [0, 4, 4]  # the old rule put all eight on b


def test_replicas_on_every_node_spread_the_backup_evenly():
    loc = location([[0, 1, 2, 3], [2, 3, 0, 1]], 4, 4)
    shares = backup_shares(loc, {0: "a", 1: "b"}, ["a", "b"])
    assert sorted(len(items) for items in shares.values()) == [2, 2]  # the old rule put all four on b


def test_one_node_backs_up_everything_fewest_copies_first():
    loc = location([[0, 1, 2, 1], [3, 1, 2, 2]], 4, 4)
    shares = backup_shares(loc, {0: "a", 1: "a"}, ["a"])
    assert [e for _, e in shares["a"]] == [0, 3, 1, 2]  # one copy each of 0 and 3, three of 1 and 2
