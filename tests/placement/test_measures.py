import numpy as np

from elastic_ep.placement import (
    ExpertLocation,
    balancedness,
    experts_without_live_replica,
    rank_loads,
    replicas_sharing_node,
    slots_moved,
)

# rank 0: experts 0, 1; rank 1: experts 2, 0 -> expert 0's load splits over two replicas
LOC = ExpertLocation.from_phy2log([[0, 1, 2, 0]], slots_per_rank=2, num_experts=3)
LOAD = np.array([[40.0, 10.0, 30.0]])


def test_rank_load_splits_an_expert_over_its_replicas():
    assert rank_loads(LOC, LOAD).tolist() == [[30.0, 50.0]]
    assert balancedness(LOC, LOAD).tolist() == [40.0 / 50.0]


def test_balancedness_accounts_for_speed():
    # rank 1 twice as fast: ideal time 80 / 3, slowest is rank 0 at 30
    assert np.allclose(balancedness(LOC, LOAD, rank_speeds={1: 2.0}), [(80 / 3) / 30])


def test_sharing_lost_and_moved():
    assert replicas_sharing_node(LOC, {0: "a", 1: "a"}) == 1
    assert replicas_sharing_node(LOC, {0: "a", 1: "b"}) == 0
    assert experts_without_live_replica(LOC, [1]) == [(0, 1)]
    moved = ExpertLocation.from_phy2log([[1, 0, 2, 1]], slots_per_rank=2, num_experts=3)
    assert slots_moved(LOC, moved) == 1  # rank 0 only reorders; rank 1 needs expert 1
