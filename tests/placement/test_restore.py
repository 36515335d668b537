import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ep.errors import PlacementError
from elastic_ep.placement import ExpertLocation, balancedness, fault_aware_placement, plan_transfers
from elastic_ep.placement.location import EMPTY
from elastic_ep.placement.restore import restore_placement, step_towards


@st.composite
def losses(draw):
    """A balanced placement with redundancy, a load, and a set of dead ranks the rest survive."""
    num_layers = draw(st.integers(1, 3))
    slots = draw(st.integers(2, 5))
    num_ranks = draw(st.integers(2, 6))
    num_experts = draw(st.integers(1, slots * (num_ranks - 1)))
    nodes = {r: f"n{r % draw(st.integers(1, 2))}" for r in range(num_ranks)}
    load = np.array(draw(st.lists(st.integers(1, 1000), min_size=num_layers * num_experts,
                                  max_size=num_layers * num_experts)), dtype=float).reshape(num_layers, num_experts)
    placement = fault_aware_placement(load, range(num_ranks), nodes, None, slots, num_ranks)
    min_live = -(-num_experts // slots)
    live = sorted(draw(st.lists(st.sampled_from(range(num_ranks)), min_size=min_live, max_size=num_ranks - 1,
                                unique=True)))
    return placement, load, live, nodes


def reference_restore(held, load, holding_ranks, rank_nodes, backup_nodes=None):
    """restore_placement's definition as first written (a tuple per candidate slot per lost
    expert, the least taken): the vectorized function must choose the same slots."""
    w = np.asarray(load, dtype=np.float64)
    num_layers, num_experts, s = held.num_layers, held.num_experts, held.slots_per_rank
    if w.shape != (num_layers, num_experts):
        raise PlacementError(f"load must be [L={num_layers}, E={num_experts}], got {list(w.shape)}")
    holding = sorted({int(r) for r in holding_ranks if 0 <= int(r) < held.num_ranks})
    if len(holding) * s < num_experts:
        raise PlacementError(f"{len(holding)} ranks x {s} slots cannot hold {num_experts} experts")
    backup_nodes = backup_nodes or {}
    grid = held.by_rank().copy()
    outside = np.ones(held.num_ranks, dtype=bool)
    outside[holding] = False
    grid[:, outside] = EMPTY
    restores = dict.fromkeys(holding, 0)
    for layer in range(num_layers):
        row = grid[layer]
        count = np.bincount(row[row >= 0], minlength=num_experts)
        for expert in sorted(np.nonzero(count == 0)[0].tolist(), key=lambda e: -w[layer, e]):
            per_copy = np.where(count > 0, w[layer] / np.maximum(count, 1), 0.0)
            rank_load = {r: float(per_copy[row[r][row[r] >= 0]].sum()) for r in holding}
            home = backup_nodes.get((layer, expert))
            options = []
            for r in holding:
                for j in range(s):
                    x = int(row[r, j])
                    if x >= 0 and count[x] < 2:
                        continue
                    donor = 0.0 if x < 0 else w[layer, x] / (count[x] - 1)
                    away = home is not None and rank_nodes.get(r) != home
                    options.append((away, restores[r], x >= 0, donor, rank_load[r], r, j))
            *_, r, j = min(options)
            if row[r, j] >= 0:
                count[row[r, j]] -= 1
            row[r, j] = expert
            count[expert] += 1
            restores[r] += 1
    return ExpertLocation.from_phy2log(grid.reshape(num_layers, -1), s, num_experts)


@st.composite
def restore_inputs(draw):
    """A loss as recovery meets it: a balanced placement, some ranks lost, some surviving slots
    suspect (empty), some lost ranks back empty, a backup of some experts on some node, integer
    or real loads, up to 11 slots a rank."""
    num_layers, slots, num_ranks = draw(st.integers(1, 3)), draw(st.integers(1, 11)), draw(st.integers(2, 9))
    num_experts = draw(st.integers(1, slots * (num_ranks - 1)))
    num_nodes = draw(st.integers(1, 3))
    nodes = {r: f"n{r % num_nodes}" for r in range(num_ranks)}
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 50, (num_layers, num_experts)).astype(float) if seed % 2 else \
        rng.random((num_layers, num_experts)) * 100
    placement = fault_aware_placement(load, range(num_ranks), nodes, None, slots, num_ranks)
    live = sorted(rng.choice(num_ranks, int(rng.integers(-(-num_experts // slots), num_ranks)), replace=False).tolist())
    phy2log = placement.restricted_to(live).phy2log.copy()
    phy2log[rng.random(phy2log.shape) < 0.1] = EMPTY
    held = ExpertLocation.from_phy2log(phy2log, slots, num_experts)
    holding = sorted(live + [r for r in range(num_ranks) if r not in live and rng.random() < 0.3])
    backup = {(layer, e): f"n{int(rng.integers(0, num_nodes + 1))}" for layer in range(num_layers)
              for e in range(num_experts) if rng.random() < 0.7}
    return held, load, holding, nodes, backup


@settings(max_examples=300, deadline=None)
@given(restore_inputs())
def test_vectorized_restore_chooses_the_slots_of_its_definition(case):
    held, load, holding, nodes, backup = case
    restored = restore_placement(held, load, holding, nodes, backup)
    expected = reference_restore(held, load, holding, nodes, backup)
    assert restored.phy2log.tolist() == expected.phy2log.tolist()
    restored.validate(holding)


@settings(max_examples=150, deadline=None)
@given(losses())
def test_restore_serves_every_expert_and_moves_only_the_lost_ones(case):
    placement, load, live, nodes = case
    held = placement.restricted_to(live)
    lost = int((held.logcnt == 0).sum())
    backup = {(layer, e): nodes[live[0]] for layer in range(held.num_layers) for e in range(held.num_experts)}
    restored = restore_placement(held, load, live, nodes, backup)
    restored.validate(live)
    changed = np.argwhere(restored.phy2log != held.phy2log)
    assert len(changed) == lost
    for layer, slot in changed:  # a slot is taken only from an expert that keeps a copy
        old = held.phy2log[layer, slot]
        assert old < 0 or restored.logcnt[layer, old] >= 1
    plan = plan_transfers(held, restored, live, nodes, backup, expert_nbytes=1)
    assert plan.bytes_by_source["peer"] == 0 and plan.bytes_by_source["disk"] == 0
    assert plan.bytes_by_source["backup"] == lost


def test_restores_spread_over_ranks_and_go_to_the_backups_node():
    # 4 ranks x 4 slots, experts 0-7 twice, rank 3 held the only copies of 8..11: lost with it
    phy2log = [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11] + [4, 5, 6, 7]]
    placement = ExpertLocation.from_phy2log(phy2log, 4, 12)
    held = placement.restricted_to([0, 1, 2, 4])
    nodes = {0: "a", 1: "a", 2: "a", 4: "b"}
    load = np.ones((1, 12))
    restored = restore_placement(held, load, [0, 1, 2, 4], nodes, {(0, e): "a" for e in range(12)})
    per_rank = [(restored.experts_of_rank(r) != held.experts_of_rank(r)).sum() for r in (0, 1, 2, 4)]
    assert per_rank[:3] in ([1, 1, 2], [1, 2, 1], [2, 1, 1]) and per_rank[3] == 0  # node a only, spread
    no_backup = restore_placement(held, load, [0, 1, 2, 4], nodes)
    assert sorted((no_backup.experts_of_rank(r) != held.experts_of_rank(r)).sum() for r in (0, 1, 2, 4)) == [1] * 4


def test_empty_slots_of_a_restarted_rank_are_used_before_taking_a_copy_away():
    # ranks 1 and 3 restarted empty; experts 2 and 3 were only on rank 1
    held = ExpertLocation.from_phy2log([[0, 1, -1, -1, 0, 1, -1, -1]], 2, 4)
    restored = restore_placement(held, np.ones((1, 4)), [0, 1, 2, 3], dict.fromkeys(range(4), "n"))
    assert restored.phy2log[0].tolist() == [0, 1, 2, -1, 0, 1, 3, -1]


def test_too_few_slots_is_an_error():
    held = ExpertLocation.from_phy2log([[0, 1, 2, 3]], 2, 4).restricted_to([0])
    with pytest.raises(PlacementError, match="cannot hold 4 experts"):
        restore_placement(held, np.ones((1, 4)), [0], {0: "n"})


@settings(max_examples=150, deadline=None)
@given(losses(), st.integers(1, 6))
def test_stepping_reaches_the_target_through_placements_that_serve(case, max_slots):
    placement, load, live, nodes = case
    current = restore_placement(placement.restricted_to(live), load, live, nodes)
    target = fault_aware_placement(load, live, nodes, None, placement.slots_per_rank, placement.num_ranks,
                                   current=current, movement_tolerance=0.0)
    total = int((current.phy2log != target.phy2log).sum())
    steps = 0
    while current != target:
        nxt = step_towards(current, target, max_slots, load)
        nxt.validate(live)
        assert 0 < (nxt.phy2log != current.phy2log).sum()
        current, steps = nxt, steps + 1
        assert steps <= total
    assert balancedness(current, load, live).min() == pytest.approx(balancedness(target, load, live).min())


def test_a_swap_of_two_single_copies_moves_together():
    current = ExpertLocation.from_phy2log([[0, 1, 2, 3]], 2, 4)
    target = ExpertLocation.from_phy2log([[0, 2, 1, 3]], 2, 4)
    assert step_towards(current, target, 1, np.ones((1, 4))) == target


def test_a_recovery_never_builds_log2phy(monkeypatch):
    """log2phy [L, E, R] is padded to the most replicated expert's copies (~120 MB at 1,024 ranks)
    and only a worker's routing reads it: the controller's recovery (the held placement, the
    restore, the transfer plan, the background steps, the backup shares, the snapshot's slot map)
    must not build it; reading it builds it from phy2log."""
    import elastic_ep.placement.location as location
    from elastic_ep.control.membership.backup_shares import backup_shares

    built = location.build_log2phy

    def refused(*_args):
        raise AssertionError("log2phy built")

    monkeypatch.setattr(location, "build_log2phy", refused)
    ranks, slots, experts = 8, 3, 16
    nodes = {r: f"n{r // 2}" for r in range(ranks)}
    load = np.stack([np.random.default_rng(layer).permutation(100.0 / np.arange(1, experts + 1)) for layer in range(2)])
    placement = fault_aware_placement(load, range(ranks), nodes, None, slots, ranks)
    live = [r for r in range(ranks) if nodes[r] != "n1"]
    held = placement.restricted_to(live)
    new = restore_placement(held, load, live, nodes, {(0, 1): "n0"})
    new.validate(live)
    plan = plan_transfers(held, new, live, nodes, {(0, 1): "n0"}, 1)
    assert plan.moves()
    step_towards(new, fault_aware_placement(load, live, nodes, None, slots, ranks), 2, load)
    backup_shares(new, nodes, sorted(set(nodes.values())))
    new.slot_map_dict()
    assert new == ExpertLocation.from_phy2log(new.phy2log, slots, experts)
    monkeypatch.setattr(location, "build_log2phy", built)
    assert new.log2phy is new.log2phy  # built once on first read, then kept
    assert new.log2phy.shape[:2] == (2, experts) and (new.log2phy >= 0).sum() == (new.phy2log >= 0).sum()
