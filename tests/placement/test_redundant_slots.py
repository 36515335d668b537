"""The redundant-slot count that outlives a rank or node loss, checked against the placement itself."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ep.errors import PlacementError
from elastic_ep.placement import (
    Survival,
    choose_redundant_experts,
    experts_without_live_replica,
    fault_aware_placement,
    losses_survived,
)


def test_issue_12_sixteen_experts_on_four_ranks_need_eight_more_slots():
    # 3 ranks x 4 slots cannot hold 16 experts; 3 ranks x 6 slots can.
    choice = choose_redundant_experts(16, 4, num_layers=3, expert_bytes=1000)
    assert (choice.redundant_experts, choice.slots_per_rank, choice.target) == (8, 6, "rank")
    assert choice.survives == Survival(rank_losses=1, node_losses=0)
    assert choice.extra_bytes == 8 * 3 * 1000 and choice.expert_bytes_per_rank == 6 * 3 * 1000
    assert losses_survived(16, 4, 0) == Survival(rank_losses=0, node_losses=0)


@pytest.mark.parametrize("experts, ep_size, redundant", [(16, 2, 16), (256, 8, 40)])  # 256 + 40 = 8 x 37
def test_one_rank_fewer_holds_every_expert(experts, ep_size, redundant):
    choice = choose_redundant_experts(experts, ep_size, 1, 1)
    assert choice.redundant_experts == redundant
    assert (ep_size - 1) * choice.slots_per_rank >= experts > (ep_size - 1) * (choice.slots_per_rank - 1)


def test_deepseek_v3_on_eight_gpu_nodes_survives_its_largest_node():
    # EP64 on 8 nodes of 8: 56 ranks must hold 256 experts, 5 slots each.
    choice = choose_redundant_experts(256, 64, num_layers=58, expert_bytes=44_000_000, ranks_per_node=8)
    assert (choice.redundant_experts, choice.slots_per_rank, choice.target) == (64, 5, "node")
    assert choice.survives == Survival(rank_losses=12, node_losses=1)
    assert choice.extra_bytes == 64 * 58 * 44_000_000


def test_uneven_nodes_plan_for_the_largest():
    nodes = {0: "a", 1: "a", 2: "a", 3: "b", 4: "c", 5: "c"}
    choice = choose_redundant_experts(12, 6, 1, 1, rank_nodes=nodes)
    assert choice.slots_per_rank == 4 and choice.redundant_experts == 12  # 3 ranks left must hold 12
    assert choice.survives == Survival(rank_losses=3, node_losses=1)  # a, then c leaves b's 4 slots
    assert choose_redundant_experts(12, 6, 1, 1, ranks_per_node=4).slots_per_rank == 6  # nodes of 4 and 2
    assert choose_redundant_experts(12, 6, 1, 1, ranks_per_node=2).slots_per_rank == 3


def test_a_single_rank_cannot_survive_and_gets_no_extra_slots():
    choice = choose_redundant_experts(8, 1, 2, 10)
    assert choice.redundant_experts == 0 and choice.survives == Survival(0, 0)


def test_counts_that_serve_refuses_name_the_nearest_valid_ones():
    with pytest.raises(PlacementError, match="do not split evenly over 48 ranks; use 32 redundant"):
        losses_survived(256, 48, 0)
    with pytest.raises(PlacementError, match="use 0 or 4 redundant"):
        losses_survived(16, 4, 2)
    with pytest.raises(PlacementError, match="must be >= 0"):
        losses_survived(16, 4, -4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_experts": 0}, "num_experts"),
        ({"ep_size": 0}, "ep_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"expert_bytes": -1}, "expert_bytes"),
        ({"ranks_per_node": 0}, "ranks_per_node"),
        ({"ranks_per_node": 2, "rank_nodes": {0: 0, 1: 0, 2: 1, 3: 1}}, "not both"),
        ({"rank_nodes": {0: 0, 1: 0, 2: 1}}, r"missing \[3\]"),
        ({"rank_nodes": {0: 0, 1: 0, 2: 1, 3: 1, 4: 1}}, r"extra \[4\]"),
    ],
)
def test_impossible_arguments_are_named(kwargs, message):
    args = {"num_experts": 16, "ep_size": 4, "num_layers": 1, "expert_bytes": 1, **kwargs}
    with pytest.raises(PlacementError, match=message):
        choose_redundant_experts(**args)


@st.composite
def groups(draw):
    """A group: experts, ranks, a rank -> node map (one node, blocks, or any), a load."""
    num_experts = draw(st.integers(1, 16))
    ep_size = draw(st.integers(2, 8))
    layout = draw(st.sampled_from(["one", "blocks", "any"]))
    if layout == "one":
        nodes = dict.fromkeys(range(ep_size), "n0")
    elif layout == "blocks":
        per_node = draw(st.integers(1, ep_size))
        nodes = {r: f"n{r // per_node}" for r in range(ep_size)}
    else:
        nodes = {r: f"n{draw(st.integers(0, ep_size - 1))}" for r in range(ep_size)}
    num_layers = draw(st.integers(1, 2))
    counts = draw(st.lists(st.integers(0, 100), min_size=num_layers * num_experts, max_size=num_layers * num_experts))
    return num_experts, ep_size, nodes, np.array(counts, dtype=float).reshape(num_layers, num_experts)


def _replace_after_loss(load, placement, nodes, dead, slots, ep_size):
    """Re-place over the survivors the way recovery does; PlacementError when they cannot serve."""
    live = [r for r in range(ep_size) if r not in dead]
    after = fault_aware_placement(load, live, nodes, None, slots, ep_size, current=placement)
    after.validate(live)
    assert experts_without_live_replica(after, live) == []


def _by_size(nodes):
    members: dict = {}
    for rank, node in nodes.items():
        members.setdefault(node, []).append(rank)
    return sorted(members.values(), key=len, reverse=True)


@settings(max_examples=80, deadline=None)
@given(groups())
def test_the_chosen_count_survives_what_it_claims_and_no_more(group):
    num_experts, ep_size, nodes, load = group
    choice = choose_redundant_experts(num_experts, ep_size, load.shape[0], 1, rank_nodes=nodes)
    slots = choice.slots_per_rank
    assert (num_experts + choice.redundant_experts) == slots * ep_size
    placement = fault_aware_placement(load, range(ep_size), nodes, None, slots, ep_size)
    survives = choice.survives
    assert survives == losses_survived(num_experts, ep_size, choice.redundant_experts, rank_nodes=nodes)

    # Every single rank, and every node short of the whole group, may die.
    for rank in range(ep_size):
        _replace_after_loss(load, placement, nodes, {rank}, slots, ep_size)
    members = _by_size(nodes)
    assert survives.rank_losses >= 1
    assert survives.node_losses == 0 if len(members) == 1 else survives.node_losses >= 1
    if len(members) > 1:
        for node in members:
            _replace_after_loss(load, placement, nodes, set(node), slots, ep_size)

    # The counts are exact: one more rank, or the next largest node, is too many.
    _replace_after_loss(load, placement, nodes, set(range(survives.rank_losses)), slots, ep_size)
    with pytest.raises(PlacementError, match="slots missing|no live ranks"):
        _replace_after_loss(load, placement, nodes, set(range(survives.rank_losses + 1)), slots, ep_size)
    largest = [r for node in members[: survives.node_losses] for r in node]
    _replace_after_loss(load, placement, nodes, set(largest), slots, ep_size)
    if survives.node_losses + 1 < len(members):
        more = largest + members[survives.node_losses]
        with pytest.raises(PlacementError, match="slots missing"):
            _replace_after_loss(load, placement, nodes, set(more), slots, ep_size)

    # The count is the fewest: one slot per rank less does not survive the target loss.
    if (slots - 1) * ep_size >= num_experts:
        fewer = fault_aware_placement(load, range(ep_size), nodes, None, slots - 1, ep_size)
        dead = set(members[0]) if choice.target == "node" else {0}
        with pytest.raises(PlacementError, match="slots missing"):
            _replace_after_loss(load, fewer, nodes, dead, slots - 1, ep_size)
