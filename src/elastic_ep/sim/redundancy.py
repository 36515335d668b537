"""Redundancy analysis: when k ranks (or k nodes) die at random, is some expert left with no
replica, and how many are lost?

Two ways to answer, on the same placements:
- Monte Carlo (seeded): draw dead sets, count experts whose replicas all sat on them;
- exact: an expert whose replicas sit on r distinct failure domains out of n is lost with
  probability C(n - r, k - r) / C(n, k), so the expected loss is a sum; the probability of
  losing at least one expert is counted exactly by inclusion-exclusion over the replica sets
  whose union fits in k domains, or, when that takes more than `max_terms` terms, bracketed by
  bounds from single and pairwise terms (Bonferroni and de Caen below, Hunter above).
A failure domain is a rank by default, or a node when a rank->node map is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from elastic_ep.errors import SimulationError
from elastic_ep.sim.placements import random_placement, replica_counts
from elastic_ep.sim.stats import mean_interval, wilson_interval

MAX_TERMS = 200_000


@dataclass(frozen=True)
class LossEstimate:
    """Loss after k domains die. `p_low`/`p_high` bracket the probability of losing at least
    one expert (a 95% interval for Monte Carlo; equal when exact; pairwise bounds otherwise);
    `lost_low`/`lost_high` do the same for the mean number of lost experts."""

    k: int
    method: str
    p_loss: float
    p_low: float
    p_high: float
    lost_mean: float
    lost_low: float
    lost_high: float


def domain_map(
    ranks: int, ranks_per_node: int | None = None, node_of_rank: list[int] | None = None
) -> np.ndarray:
    """rank -> failure domain id [ranks]: the rank itself, consecutive nodes, or a given map."""
    if node_of_rank is not None:
        if len(node_of_rank) != ranks:
            raise SimulationError(
                f"the node map names {len(node_of_rank)} ranks but the placement has {ranks}"
            )
        _, ids = np.unique(np.asarray(node_of_rank), return_inverse=True)
        return ids.astype(np.int64)
    if ranks_per_node is not None:
        if ranks_per_node <= 0:
            raise SimulationError(f"--ranks-per-node {ranks_per_node} must be > 0")
        return np.arange(ranks, dtype=np.int64) // ranks_per_node
    return np.arange(ranks, dtype=np.int64)


def replica_domain_sets(
    phy2log: np.ndarray, slots_per_rank: int, domains: np.ndarray
) -> list[frozenset[int]]:
    """The set of failure domains holding each (layer, expert) that the placement holds.

    phy2log: [L, n_slots]; domains: [ranks] domain of each rank.
    """
    slot_domain = np.repeat(domains, slots_per_rank)
    sets: list[frozenset[int]] = []
    for layer in np.atleast_2d(phy2log):
        for expert in np.unique(layer[layer >= 0]):
            sets.append(frozenset(slot_domain[layer == expert].tolist()))
    return sets


def _incidence(phy2log: np.ndarray, slots_per_rank: int, domains: np.ndarray) -> np.ndarray:
    """Replicas of each (layer, expert) column per domain: [n_domains, n_columns] float32."""
    slot_domain = np.repeat(domains, slots_per_rank)
    n_domains = int(domains.max()) + 1
    columns = []
    for layer in np.atleast_2d(phy2log):
        held = layer >= 0
        experts, col = np.unique(layer[held], return_inverse=True)
        counts = np.zeros((n_domains, len(experts)), dtype=np.float32)
        np.add.at(counts, (slot_domain[held], col), 1)
        columns.append(counts)
    return np.concatenate(columns, axis=1)


def monte_carlo_lost(
    phy2log: np.ndarray,
    slots_per_rank: int,
    domains: np.ndarray,
    k: int,
    trials: int,
    rng: np.random.Generator,
    chunk: int = 512,
) -> np.ndarray:
    """Lost experts in each of `trials` random draws of k dead domains. Returns [trials] int."""
    inc = _incidence(phy2log, slots_per_rank, domains)
    n_domains = inc.shape[0]
    _check_k(k, n_domains)
    lost = np.empty(trials, dtype=np.int64)
    for start in range(0, trials, chunk):
        n = min(chunk, trials - start)
        dead = np.argsort(rng.random((n, n_domains)), axis=1)[:, :k]
        alive = np.ones((n, n_domains), dtype=np.float32)
        np.put_along_axis(alive, dead, 0.0, axis=1)
        lost[start : start + n] = ((alive @ inc) == 0).sum(axis=1)
    return lost


def _check_k(k: int, n_domains: int) -> None:
    if k < 0:
        raise SimulationError(f"k={k}: the number of dead failure domains must be >= 0")
    if k > n_domains:
        raise SimulationError(
            f"k={k} dead failure domains is more than the {n_domains} there are: give k <= {n_domains}"
        )


def _ratio(n_domains: int, k: int, size: int) -> float:
    """P(a given set of `size` domains is all dead) when k of n_domains die."""
    if size > k:
        return 0.0
    return math.comb(n_domains - size, k - size) / math.comb(n_domains, k)


def exact_expected_lost(sets: list[frozenset[int]], n_domains: int, k: int) -> float:
    """Expected lost experts when k of n_domains die uniformly at random (exact)."""
    _check_k(k, n_domains)
    return sum(_ratio(n_domains, k, len(s)) for s in sets)


def exact_loss_probability(
    sets: list[frozenset[int]], n_domains: int, k: int, max_terms: int = MAX_TERMS
) -> tuple[float, float]:
    """P(at least one expert lost) when k of n_domains die: (low, high), equal when exact.

    Domains holding an expert's only replica must all survive; among the others, the dead
    sets that contain some replica set are counted by inclusion-exclusion over the minimal
    replica sets whose union has at most k domains. Beyond `max_terms` terms the count is
    bracketed by `_pair_bounds`.
    """
    _check_k(k, n_domains)
    sole = {d for s in sets if len(s) == 1 for d in s}
    free = n_domains - len(sole)
    family = _minimal({s for s in sets if 1 < len(s) <= k and not (s & sole)})
    total = math.comb(n_domains, k)
    outside = total - math.comb(free, k)  # dead sets that hit a sole replica
    hit = _count_containing(family, free, k, max_terms)
    if hit is not None:
        p = (outside + hit) / total
        return p, p
    low_hit, high_hit = _pair_bounds(family, free, k, max_terms)
    return (outside + low_hit) / total, min(1.0, (outside + high_hit) / total)


def _minimal(family: set[frozenset[int]]) -> list[frozenset[int]]:
    """Drop every set that contains another: a dead set containing it contains the smaller."""
    ordered = sorted(family, key=len)
    kept: list[frozenset[int]] = []
    for s in ordered:
        if not any(t <= s for t in kept):
            kept.append(s)
    return kept


def _count_containing(family: list[frozenset[int]], free: int, k: int, max_terms: int) -> int | None:
    """Number of k-subsets of `free` domains that contain some set of the family, by
    inclusion-exclusion; None when it would take more than max_terms terms."""
    terms = 0
    count = 0
    stack: list[tuple[int, frozenset[int], int]] = [(i, s, 1) for i, s in enumerate(family)]
    while stack:
        i, union, sign = stack.pop()
        terms += 1
        if terms > max_terms:
            return None
        count += sign * math.comb(free - len(union), k - len(union))
        for j in range(i + 1, len(family)):
            grown = union | family[j]
            if len(grown) <= k:
                stack.append((j, grown, -sign))
    return count


def _pair_bounds(family: list[frozenset[int]], free: int, k: int, max_terms: int) -> tuple[float, float]:
    """Bounds on the count of `_count_containing` from single and pairwise terms: below, the
    larger of Bonferroni's S1 - S2 and de Caen's sum_i c_i^2 / sum_j c_ij; above, Hunter's S1
    minus a maximum spanning tree of the pair terms. Past max_terms pairs: (largest term, S1)."""
    singles = [math.comb(free - len(s), k - len(s)) for s in family]
    s1 = sum(singles)
    row = list(singles)
    edges: list[tuple[int, int, int]] = []
    pairs = 0
    for i, a in enumerate(family):
        for j in range(i + 1, len(family)):
            pairs += 1
            if pairs > max_terms:
                return float(max(singles, default=0)), float(s1)
            union = len(a | family[j])
            if union <= k:
                both = math.comb(free - union, k - union)
                edges.append((both, i, j))
                row[i] += both
                row[j] += both
    s2 = sum(w for w, _, _ in edges)
    de_caen = sum(c * c / r for c, r in zip(singles, row, strict=True) if c)
    return max(float(s1 - s2), de_caen), float(s1 - _max_spanning_tree(edges, len(family)))


def _max_spanning_tree(edges: list[tuple[int, int, int]], nodes: int) -> int:
    """Weight of a maximum spanning forest (Kruskal) of weighted edges (w, i, j)."""
    parent = list(range(nodes))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    total = 0
    for w, i, j in sorted(edges, reverse=True):
        ri, rj = root(i), root(j)
        if ri != rj:
            parent[ri] = rj
            total += w
    return total


def analyse(
    placements: list[np.ndarray],
    slots_per_rank: int,
    domains: np.ndarray,
    ks: list[int],
    method: str,
    trials: int = 4000,
    rng: np.random.Generator | None = None,
    max_terms: int = MAX_TERMS,
) -> list[LossEstimate]:
    """Loss for each k over the given placements (each phy2log [L, n_slots]), averaged over them.

    method: "monte-carlo" (trials split evenly over the placements) or "exact".
    """
    if method not in ("monte-carlo", "exact"):
        raise SimulationError(f"unknown method {method!r}: use monte-carlo or exact")
    if max_terms < 0:
        raise SimulationError(f"--max-terms {max_terms} must be >= 0 (0: bounds only)")
    n_domains = int(domains.max()) + 1
    for k in ks:
        _check_k(k, n_domains)
    if method == "monte-carlo":
        rng = rng if rng is not None else np.random.default_rng(0)
        return [_monte_carlo_estimate(placements, slots_per_rank, domains, k, trials, rng) for k in ks]
    sets = [replica_domain_sets(p, slots_per_rank, domains) for p in placements]
    out = []
    for k in ks:
        bounds = np.array([exact_loss_probability(s, n_domains, k, max_terms) for s in sets])
        lost = float(np.mean([exact_expected_lost(s, n_domains, k) for s in sets]))
        low, high = float(bounds[:, 0].mean()), float(bounds[:, 1].mean())
        kind = "exact" if low == high else "bounds"
        out.append(LossEstimate(k, kind, (low + high) / 2, low, high, lost, lost, lost))
    return out


def _monte_carlo_estimate(
    placements: list[np.ndarray],
    slots_per_rank: int,
    domains: np.ndarray,
    k: int,
    trials: int,
    rng: np.random.Generator,
) -> LossEstimate:
    if trials < 2:
        raise SimulationError(f"--trials {trials}: Monte Carlo needs at least 2 draws for an interval")
    share = -(-trials // len(placements))
    lost = np.concatenate([monte_carlo_lost(p, slots_per_rank, domains, k, share, rng) for p in placements])
    hits = int((lost > 0).sum())
    p_low, p_high = wilson_interval(hits, len(lost))
    mean, half = mean_interval(lost.astype(np.float64))
    assert half is not None, "at least 2 draws"
    return LossEstimate(k, "monte-carlo", hits / len(lost), p_low, p_high, mean, mean - half, mean + half)


@dataclass(frozen=True)
class RandomConfig:
    """A deployment to place at random: `redundant` extra copies go to the hottest experts."""

    name: str
    ranks: int
    slots_per_rank: int
    experts: int = 256
    redundant: int = 0


# Three reference configurations: large-EP prefill and decode, then every expert twice.
SEED_001_CONFIGS = (
    RandomConfig("EP32 x 9 slots, 32 redundant", 32, 9, 256, 32),
    RandomConfig("EP320 x 1 slot, 64 redundant", 320, 1, 256, 64),
    RandomConfig("EP64 x 8 slots, every expert twice", 64, 8, 256, 256),
)


def random_placements(
    cfg: RandomConfig, count: int, rng: np.random.Generator, ranks_per_domain: int = 1
) -> list[np.ndarray]:
    """`count` random placements of cfg, each phy2log [1, ranks * slots_per_rank]."""
    if count <= 0:
        raise SimulationError(f"--placements {count} must be > 0")
    replicas = replica_counts(cfg.experts, cfg.redundant)
    return [
        random_placement(replicas, cfg.ranks, cfg.slots_per_rank, rng, ranks_per_domain)[None, :]
        for _ in range(count)
    ]
