"""Seed 001's second table: Monte Carlo within sampling error, exact mode, bounds, nodes."""

import itertools
import json
import math

import numpy as np
import pytest

from elastic_ep.errors import SimulationError
from elastic_ep.sim.placements import random_placement, read_placement_file, replica_counts
from elastic_ep.sim.redundancy import (
    SEED_001_CONFIGS,
    analyse,
    domain_map,
    exact_expected_lost,
    exact_loss_probability,
    monte_carlo_lost,
    random_placements,
    replica_domain_sets,
)

KS = [1, 2, 4]
# Seed 001 table 2: (P(some expert lost), mean lost) for k = 1, 2, 4, from 4000 draws each.
SEED_TABLE = [
    [(1.00, 6.98), (1.00, 14.00), (1.00, 28.40)],
    [(0.59, 0.59), (0.84, 1.20), (0.98, 2.40)],
    [(0.00, 0.00), (0.12, 0.13), (0.56, 0.78)],
]
SEED_TRIALS = 4000
Z = 4.0  # tolerance in standard errors: a false alarm once in ~16,000 checks


def _seed_case(i, seed=0):
    cfg = SEED_001_CONFIGS[i]
    placement = random_placements(cfg, 1, np.random.default_rng(seed))[0]
    return cfg, placement, domain_map(cfg.ranks)


@pytest.mark.parametrize("i", range(3))
def test_seed_table_lies_within_sampling_error_of_the_exact_values(i):
    """The seed's printed Monte Carlo figures (rounded) sit within Z binomial standard errors of
    the exact values; the spread of the mean comes from our own draws on the same config."""
    cfg, placement, domains = _seed_case(i)
    sets = replica_domain_sets(placement, cfg.slots_per_rank, domains)
    rng = np.random.default_rng(1)
    for k, (seed_p, seed_lost) in zip(KS, SEED_TABLE[i], strict=True):
        p = exact_loss_probability(sets, cfg.ranks, k)[0]
        lost = exact_expected_lost(sets, cfg.ranks, k)
        p_se = math.sqrt(p * (1 - p) / SEED_TRIALS)
        assert abs(seed_p - p) <= Z * p_se + 0.005, (k, seed_p, p)
        sd = np.std(monte_carlo_lost(placement, cfg.slots_per_rank, domains, k, 2000, rng), ddof=1)
        assert abs(seed_lost - lost) <= Z * sd / math.sqrt(SEED_TRIALS) + 0.005, (k, seed_lost, lost)


def test_expected_losses_are_the_closed_forms():
    # 224 single-copy experts on 32 ranks: k/32 of them die; a pair dies with C(30,k-2)/C(32,k)
    cfg, placement, domains = _seed_case(0)
    sets = replica_domain_sets(placement, cfg.slots_per_rank, domains)
    for k in KS:
        expected = 224 * k / 32 + 32 * math.comb(30, k - 2) / math.comb(32, k) if k >= 2 else 224 / 32
        assert exact_expected_lost(sets, 32, k) == pytest.approx(expected)
    # EP320 x 1: P(loss, k=2) = 1 - (C(128, 2) - 64) / C(320, 2)
    cfg, placement, domains = _seed_case(1)
    sets = replica_domain_sets(placement, 1, domains)
    p = exact_loss_probability(sets, 320, 2)
    assert p[0] == p[1] == pytest.approx(1 - (math.comb(128, 2) - 64) / math.comb(320, 2))


@pytest.mark.parametrize("i", range(3))
def test_exact_mode_agrees_with_monte_carlo_on_the_seed_configurations(i):
    cfg, placement, domains = _seed_case(i)
    trials = 2000
    mc = analyse(
        [placement], cfg.slots_per_rank, domains, KS, "monte-carlo", trials, np.random.default_rng(2)
    )
    exact = analyse([placement], cfg.slots_per_rank, domains, KS, "exact")
    for m, e in zip(mc, exact, strict=True):
        assert e.method == "exact"
        assert abs(m.p_loss - e.p_loss) <= Z * math.sqrt(e.p_loss * (1 - e.p_loss) / trials), (m, e)
        mean_se = (m.lost_high - m.lost_mean) / 1.96  # the half-width is 1.96 standard errors
        assert abs(m.lost_mean - e.lost_mean) <= Z * mean_se + 1e-12, (m, e)


def _brute_force(sets, n_domains, k):
    dead_sets = list(itertools.combinations(range(n_domains), k))
    lost = [sum(s <= set(d) for s in sets) for d in dead_sets]
    return sum(x > 0 for x in lost) / len(dead_sets), sum(lost) / len(dead_sets)


@pytest.mark.parametrize(
    "ranks, slots, experts, redundant, per_node", [(8, 3, 16, 8, 1), (10, 4, 12, 28, 1), (12, 2, 12, 12, 3)]
)
def test_exact_mode_equals_enumerating_every_dead_set(ranks, slots, experts, redundant, per_node):
    rng = np.random.default_rng(3)
    placement = random_placement(replica_counts(experts, redundant), ranks, slots, rng)[None, :]
    domains = domain_map(ranks, per_node)
    n_domains = int(domains.max()) + 1
    sets = replica_domain_sets(placement, slots, domains)
    for k in range(1, n_domains + 1):
        p_true, lost_true = _brute_force(sets, n_domains, k)
        low, high = exact_loss_probability(sets, n_domains, k)
        assert low == high == pytest.approx(p_true, abs=1e-12)
        assert exact_expected_lost(sets, n_domains, k) == pytest.approx(lost_true)


def test_bounds_bracket_the_exact_value_when_terms_run_out():
    cfg, placement, domains = _seed_case(2)
    sets = replica_domain_sets(placement, cfg.slots_per_rank, domains)
    exact = exact_loss_probability(sets, 64, 4)[0]
    union_bound = len(set(sets)) * math.comb(62, 2) / math.comb(64, 4)
    for max_terms in (100, 40_000):  # too few for pairs; enough for pairs, too few for all orders
        low, high = exact_loss_probability(sets, 64, 4, max_terms=max_terms)
        assert low < exact < high <= union_bound
    assert high < union_bound - 0.01  # the spanning-tree bound improves on the union bound
    assert exact - low < 0.05


def test_random_placement_keeps_replicas_on_distinct_ranks_and_nodes():
    rng = np.random.default_rng(4)
    replicas = replica_counts(256, 256)
    for per_domain, tries in [(1, 2000), (8, 2000), (1, 0)]:
        placement = random_placement(replicas, 64, 8, rng, ranks_per_domain=per_domain, max_tries=tries)
        assert np.array_equal(np.bincount(placement[placement >= 0], minlength=256), replicas)
        grid = placement.reshape(64 // per_domain, 8 * per_domain)
        assert all(len(set(row)) == len(row) for row in grid.tolist())


def test_node_failures_spare_a_node_spread_placement_and_hurt_a_rank_spread_one():
    rng = np.random.default_rng(5)
    replicas = replica_counts(256, 256)
    nodes = domain_map(64, 8)
    spread = random_placement(replicas, 64, 8, rng, ranks_per_domain=8)[None, :]
    careless = random_placement(replicas, 64, 8, rng)[None, :]
    (safe,) = analyse([spread], 8, nodes, [1], "exact")
    (risky,) = analyse([careless], 8, nodes, [1], "exact")
    assert safe.p_loss == 0 and safe.lost_mean == 0
    assert risky.p_loss > 0.9 and risky.lost_mean > 1


def test_placement_file_is_read_with_slots_from_option_or_file(tmp_path):
    phy2log = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, -1, 2]]
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"phy2log": phy2log, "log2phy": [], "logcnt": []}))
    got, ranks, slots = read_placement_file(path, 2)
    assert (ranks, slots) == (3, 2) and got.tolist() == phy2log
    with pytest.raises(SimulationError, match="give --slots"):
        read_placement_file(path)
    with pytest.raises(SimulationError, match="does not divide"):
        read_placement_file(path, 4)
    path.write_text(json.dumps({"phy2log": phy2log, "slots_per_rank": 3}))
    assert read_placement_file(path)[1:] == (2, 3)
    path.write_text(json.dumps({"phy2log": phy2log, "slots_per_rank": 3, "num_experts": 5}))
    with pytest.raises(SimulationError, match=r"layer 0 .* no replica of expert\(s\) \[4\]"):
        read_placement_file(path)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: random_placement(replica_counts(256, 0), 4, 1, np.random.default_rng(0)), "do not fit"),
        (
            lambda: random_placement(replica_counts(4, 12), 2, 8, np.random.default_rng(0)),
            "only 2 failure domains",
        ),
        (lambda: exact_expected_lost([frozenset({0})], 4, 5), "k=5"),
    ],
)
def test_impossible_inputs_name_the_problem(call, message):
    with pytest.raises(SimulationError, match=message):
        call()
