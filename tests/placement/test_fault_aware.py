import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ep.errors import PlacementError
from elastic_ep.placement import (
    ExpertLocation,
    balancedness,
    fault_aware_placement,
    plan_transfers,
    rank_loads,
    rebalance_experts,
    replicas_sharing_node,
    slots_moved,
)


@st.composite
def clusters(draw):
    """A load, a rank/node layout, speeds and a live set big enough to hold every expert."""
    num_layers = draw(st.integers(1, 3))
    slots = draw(st.integers(1, 4))
    num_experts = draw(st.integers(1, min(16, 8 * slots)))
    num_ranks = draw(st.integers(max(1, -(-num_experts // slots)), 8))
    num_nodes = draw(st.integers(1, num_ranks))
    rank_nodes = {r: f"node{r % num_nodes}" for r in range(num_ranks)}
    min_live = -(-num_experts // slots)
    live = draw(st.lists(st.sampled_from(range(num_ranks)), min_size=min_live, max_size=num_ranks, unique=True))
    loads = draw(st.lists(st.integers(0, 1000), min_size=num_layers * num_experts, max_size=num_layers * num_experts))
    load = np.array(loads, dtype=float).reshape(num_layers, num_experts)
    speeds = {r: draw(st.sampled_from([0.5, 1.0, 2.0])) for r in range(num_ranks)}
    return load, rank_nodes, speeds, slots, num_ranks, sorted(live)


def assert_serves(loc: ExpertLocation, live, slots, num_experts):
    loc.validate(live)
    filled = (loc.by_rank() >= 0).sum(axis=2)
    assert (filled[:, live] == min(slots, num_experts)).all(), "every live slot holds an expert"
    assert (loc.logcnt <= len(live)).all()


def assert_plan_rebuilds(old, new, live_now, rank_nodes, backup):
    plan = plan_transfers(old, new, live_now, rank_nodes, backup, expert_nbytes=10)
    rebuilt = np.full(new.phy2log.shape, -1)
    for t in plan.transfers:
        assert rebuilt[t.layer, t.dst_slot] == -1, "one transfer per destination slot"
        rebuilt[t.layer, t.dst_slot] = t.expert
        if t.source in ("keep", "local", "peer"):
            assert t.src_rank in live_now, "a dead rank is never a source"
            assert old.phy2log[t.layer, t.src_slot] == t.expert
            assert (t.src_rank == t.dst_rank) == (t.source != "peer")
        holders = [s for s in np.nonzero(old.phy2log[t.layer] == t.expert)[0] if s // old.slots_per_rank in live_now]
        if t.source == "backup":
            assert not holders and backup[(t.layer, t.expert)] is not None
        if t.source == "disk":
            assert not holders and (t.layer, t.expert) not in backup
    assert np.array_equal(rebuilt, new.phy2log), "the plan turns the old placement into the new one"
    moved = sum(1 for t in plan.transfers if t.source in ("peer", "backup", "disk"))
    assert plan.bytes_moved == 10 * moved == 10 * slots_moved(old, new)
    return plan


@settings(max_examples=60, deadline=None)
@given(clusters(), st.data())
def test_failure_replacement_keeps_invariants_and_plan_is_exact(cluster, data):
    load, rank_nodes, speeds, slots, num_ranks, live = cluster
    before = fault_aware_placement(load, range(num_ranks), rank_nodes, speeds, slots, num_ranks)
    assert_serves(before, list(range(num_ranks)), slots, load.shape[1])
    after = fault_aware_placement(load, live, rank_nodes, speeds, slots, num_ranks, current=before)
    assert_serves(after, live, slots, load.shape[1])
    backup = {k: "node0" for k in data.draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 15))))}
    assert_plan_rebuilds(before, after, live, rank_nodes, backup)


@settings(max_examples=60, deadline=None)
@given(clusters(), st.integers(0, 4), st.data())
def test_scale_up_and_down_keep_invariants(cluster, extra, data):
    load, rank_nodes, speeds, slots, num_ranks, live = cluster
    before = fault_aware_placement(load, live, rank_nodes, speeds, slots, num_ranks)
    bigger = num_ranks + extra
    nodes = {r: rank_nodes.get(r, "new-node") for r in range(bigger)}
    min_ranks = -(-load.shape[1] // slots)
    new_ranks = data.draw(st.integers(min_ranks, bigger))
    new_live = list(range(new_ranks))
    after = fault_aware_placement(load, new_live, nodes, speeds, slots, new_ranks, current=before)
    assert after.num_ranks == new_ranks
    assert_serves(after, new_live, slots, load.shape[1])
    # ranks being drained are still alive and may send
    assert_plan_rebuilds(before, after, sorted(set(new_live) | set(live)), nodes, None)


@settings(max_examples=60, deadline=None)
@given(clusters())
def test_same_inputs_move_nothing(cluster):
    load, rank_nodes, speeds, slots, num_ranks, live = cluster
    first = fault_aware_placement(load, live, rank_nodes, speeds, slots, num_ranks)
    again = fault_aware_placement(load, live, rank_nodes, speeds, slots, num_ranks, current=first)
    assert again == first


def _skewed(num_layers=4, num_experts=64, seed=0):
    return np.random.default_rng(seed).lognormal(0, 1.0, (num_layers, num_experts)) * 100


def test_one_dead_rank_moves_far_less_than_recomputing():
    load = _skewed()
    nodes = {r: r // 4 for r in range(16)}
    before = fault_aware_placement(load, range(16), nodes, None, 5, 16)
    live = [r for r in range(16) if r != 6]
    after = fault_aware_placement(load, live, nodes, None, 5, 16, current=before)
    scratch = fault_aware_placement(load, live, nodes, None, 5, 16)
    assert slots_moved(before, after) * 2 <= slots_moved(before, scratch)
    assert balancedness(after, load, live).mean() >= 0.98 * balancedness(scratch, load, live).mean()


def test_at_least_as_balanced_as_deepseek_global():
    load = _skewed()
    nodes = {r: 0 for r in range(16)}
    ours = fault_aware_placement(load, range(16), nodes, None, 5, 16)
    phy2log, _, _ = rebalance_experts(load, 80, 1, 1, 16)
    theirs = ExpertLocation.from_phy2log(phy2log, 5, 64)
    assert balancedness(ours, load).mean() >= balancedness(theirs, load).mean()


def test_replicas_of_an_expert_go_to_different_nodes():
    load = np.ones((1, 16))
    load[0, 3] = 3.5  # hot: 4 replicas, one per node
    nodes = {r: r // 2 for r in range(8)}  # 4 nodes x 2 ranks
    loc = fault_aware_placement(load, range(8), nodes, None, 3, 8)
    hot_nodes = [nodes[s // 3] for s in loc.log2phy[0, 3] if s >= 0]
    assert sorted(hot_nodes) == [0, 1, 2, 3]
    assert replicas_sharing_node(loc, nodes) == 0


def test_a_slow_rank_gets_less_load():
    load = _skewed(num_layers=2)
    nodes = {r: 0 for r in range(8)}
    loc = fault_aware_placement(load, range(8), nodes, {2: 0.25}, 10, 8)
    per_rank = rank_loads(loc, load)
    others = np.delete(per_rank, 2, axis=1)
    assert (per_rank[:, 2] < 0.6 * others.mean(axis=1)).all()
    assert (balancedness(loc, load, rank_speeds={2: 0.25}) > 0.9).all()


def test_not_enough_live_slots_says_how_many_are_missing():
    with pytest.raises(PlacementError, match="7 slots missing"):
        fault_aware_placement(np.ones((1, 16)), [0, 1, 2], {0: 0, 1: 0, 2: 0}, None, 3, 4)


def test_unknown_node_of_a_live_rank_is_an_error():
    with pytest.raises(PlacementError, match="no node for live ranks \\[1\\]"):
        fault_aware_placement(np.ones((1, 2)), [0, 1], {0: 0}, None, 2, 2)
