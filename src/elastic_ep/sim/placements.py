"""Expert placements for the redundancy analysis: built at random, or read from a file.

A placement of one layer is `phy2log [n_slots]` with `n_slots = ranks * slots_per_rank`;
slot `r * slots_per_rank + j` is slot j of rank r and -1 marks an empty slot. Several layers
stack to `phy2log [L, n_slots]`, the format `elastic-ep eplb` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from elastic_ep.errors import SimulationError


def replica_counts(experts: int, redundant: int) -> np.ndarray:
    """Replicas per logical expert: one each, plus `redundant` extra copies given to the
    hottest experts first (expert 0 is the hottest), one more round when redundant > experts.

    Returns: [experts] int.
    """
    if experts <= 0:
        raise SimulationError(f"--experts {experts} must be > 0")
    if redundant < 0:
        raise SimulationError(f"--redundant {redundant} must be >= 0")
    counts = np.ones(experts, dtype=np.int64)
    counts += redundant // experts
    counts[: redundant % experts] += 1
    return counts


def check_fits(replicas: np.ndarray, ranks: int, slots_per_rank: int, spread_units: int) -> None:
    """Raise a SimulationError when the replicas cannot be placed on distinct units."""
    if ranks <= 0 or slots_per_rank <= 0:
        raise SimulationError(f"ranks ({ranks}) and slots per rank ({slots_per_rank}) must be > 0")
    copies = int(replicas.sum())
    if copies > ranks * slots_per_rank:
        raise SimulationError(
            f"{copies} expert copies do not fit in {ranks} ranks x {slots_per_rank} slots = "
            f"{ranks * slots_per_rank} slots: add slots or ranks, or fewer redundant experts"
        )
    if int(replicas.max()) > spread_units:
        raise SimulationError(
            f"an expert has {int(replicas.max())} replicas but there are only {spread_units} failure "
            f"domains to put them on: give fewer redundant experts"
        )


def random_placement(
    replicas: np.ndarray,
    ranks: int,
    slots_per_rank: int,
    rng: np.random.Generator,
    ranks_per_domain: int = 1,
    max_tries: int = 2000,
) -> np.ndarray:
    """A uniformly random placement in which no two replicas of an expert share a failure
    domain (a rank, or a node of `ranks_per_domain` consecutive ranks): shuffle and reject. When `max_tries`
    shuffles would likely all be rejected, a shuffle is repaired
    by swaps instead (close to uniform, not exactly).

    replicas: [E] copies per expert. Returns phy2log [ranks * slots_per_rank], -1 = empty slot.
    """
    domains = -(-ranks // ranks_per_domain)
    check_fits(replicas, ranks, slots_per_rank, domains)
    n_slots = ranks * slots_per_rank
    copies = np.full(n_slots, -1, dtype=np.int64)
    copies[: int(replicas.sum())] = np.repeat(np.arange(len(replicas)), replicas)
    slots_per_domain = ranks_per_domain * slots_per_rank
    # Poisson estimate of the chance that a shuffle puts no two replicas in one domain
    same_domain_pairs = (
        float((replicas * (replicas - 1) / 2).sum()) * (slots_per_domain - 1) / max(n_slots - 1, 1)
    )
    tries = max_tries if np.exp(-same_domain_pairs) * max_tries >= 1 else 0
    for _ in range(tries):
        shuffled = rng.permutation(copies)
        if not _domain_duplicates(_by_domain(shuffled, domains, slots_per_domain)):
            return shuffled
    return _repair(rng.permutation(copies), domains, slots_per_domain, rng)


def _by_domain(phy2log: np.ndarray, domains: int, slots_per_domain: int) -> np.ndarray:
    padded = np.full(domains * slots_per_domain, -1, dtype=np.int64)
    padded[: len(phy2log)] = phy2log
    return padded.reshape(domains, slots_per_domain)


def _domain_duplicates(grid: np.ndarray) -> bool:
    ordered = np.sort(grid, axis=1)
    return bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any())


def _repair(phy2log: np.ndarray, domains: int, slots_per_domain: int, rng: np.random.Generator) -> np.ndarray:
    """Swap each duplicate copy with a random slot of another domain where both fit."""
    grid = _by_domain(phy2log, domains, slots_per_domain)
    n_slots = len(phy2log)
    for _ in range(100 * n_slots):
        dup = _first_duplicate(grid)
        if dup is None:
            return grid.reshape(-1)[:n_slots].copy()
        d, j = dup
        expert = grid[d, j]
        other = int(rng.integers(n_slots))
        od, oj = divmod(other, slots_per_domain)
        candidate = grid[od, oj]
        if od != d and expert not in grid[od] and (candidate < 0 or candidate not in grid[d]):
            grid[d, j], grid[od, oj] = candidate, expert
    raise SimulationError("could not spread every expert's replicas over distinct failure domains")


def _first_duplicate(grid: np.ndarray) -> tuple[int, int] | None:
    for d, row in enumerate(grid):
        seen: set[int] = set()
        for j, expert in enumerate(row):
            if expert >= 0 and expert in seen:
                return d, j
            seen.add(int(expert))
    return None


def read_placement_file(path: str | Path, slots_per_rank: int | None = None) -> tuple[np.ndarray, int, int]:
    """Read `phy2log [L, n_slots]` from a placement JSON written by `elastic-ep eplb`.

    The slots per rank come from `slots_per_rank` (the `--slots` option), else from the file's
    `slots_per_rank` or `num_ranks` key. Returns (phy2log [L, n_slots], ranks, slots_per_rank).
    """
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SimulationError(
            f"placement file {path} does not exist: write one with `elastic-ep eplb`"
        ) from None
    except json.JSONDecodeError as e:
        raise SimulationError(f"placement file {path} is not JSON ({e})") from None
    if not isinstance(raw, dict) or "phy2log" not in raw:
        raise SimulationError(f"placement file {path} has no phy2log [L, n_slots]")
    phy2log = np.asarray(raw["phy2log"], dtype=np.int64)
    if phy2log.ndim == 1:
        phy2log = phy2log[None, :]
    if phy2log.ndim != 2 or phy2log.shape[1] == 0:
        raise SimulationError(f"phy2log in {path} must be [L, n_slots], got shape {list(phy2log.shape)}")
    n_slots = phy2log.shape[1]
    if slots_per_rank is None:
        if "slots_per_rank" in raw:
            slots_per_rank = int(raw["slots_per_rank"])
        elif "num_ranks" in raw:
            slots_per_rank = n_slots // max(int(raw["num_ranks"]), 1)
        else:
            raise SimulationError(f"{path} does not say its slots per rank: give --slots")
    if slots_per_rank <= 0 or n_slots % slots_per_rank:
        raise SimulationError(f"--slots {slots_per_rank} does not divide the {n_slots} slots of {path}")
    experts = int(raw.get("num_experts", 0))
    for layer, row in enumerate(phy2log):
        missing = sorted(set(range(experts)) - set(row.tolist()))
        if missing:
            raise SimulationError(
                f"layer {layer} of {path} has no replica of expert(s) {missing[:8]}: it cannot serve "
                f"before any failure; recompute it with `elastic-ep eplb`"
            )
    return phy2log, n_slots // slots_per_rank, slots_per_rank
