"""Measures of a placement: balance, movement, failure-domain sharing, lost experts.

Load model: an expert's tokens split evenly over its replicas, and a rank's time is its load
divided by its relative speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from elastic_ep.errors import PlacementError
from elastic_ep.placement.location import ExpertLocation


def rank_loads(location: ExpertLocation, load) -> np.ndarray:
    """[L, num_ranks] load of each rank. load: [L, E] tokens per logical expert (array-like)."""
    w = np.asarray(load, dtype=np.float64)
    per_replica = w / np.maximum(location.logcnt, 1)
    slot_load = np.where(location.phy2log >= 0, np.take_along_axis(per_replica, np.maximum(location.phy2log, 0), 1), 0)
    return slot_load.reshape(location.num_layers, location.num_ranks, location.slots_per_rank).sum(-1)


def speed_vector(num_ranks: int, rank_speeds: Mapping[int, float] | None) -> np.ndarray:
    """[num_ranks] relative speeds, 1.0 where not given."""
    speeds = np.ones(num_ranks)
    for rank, speed in (rank_speeds or {}).items():
        if 0 <= rank < num_ranks:
            speeds[rank] = float(speed)
    return speeds


def balancedness(
    location: ExpertLocation,
    load,
    live_ranks: Iterable[int] | None = None,
    rank_speeds: Mapping[int, float] | None = None,
) -> np.ndarray:
    """[L] ideal time over actual time per layer, 1.0 = perfect.

    Ideal: total load / total speed of the live ranks (all ranks by default); actual: the slowest
    rank's load / speed. With equal speeds this is mean over max of the per-rank load.
    """
    live = np.arange(location.num_ranks) if live_ranks is None else np.array(sorted(set(live_ranks)), dtype=np.int64)
    speeds = speed_vector(location.num_ranks, rank_speeds)[live]
    loads = rank_loads(location, load)[:, live]
    worst = (loads / speeds).max(axis=1)
    ideal = loads.sum(axis=1) / speeds.sum()
    return np.divide(ideal, worst, out=np.ones_like(ideal), where=worst > 0)


def slots_moved(old: ExpertLocation, new: ExpertLocation) -> int:
    """Number of (layer, slot) of `new` whose expert its rank did not hold anywhere in `old`.

    These are the slots whose weights cross the wire (peer, backup or disk); a copy within a rank
    is not counted. Ranks beyond `old.num_ranks` (scale-up) held nothing.
    """
    if (old.num_layers, old.num_experts) != (new.num_layers, new.num_experts):
        raise PlacementError(
            f"cannot compare a placement of {old.num_layers} layers x {old.num_experts} experts "
            f"with one of {new.num_layers} x {new.num_experts}"
        )
    held = _held(old, new.num_ranks, new.num_experts)
    by_rank = new.by_rank()
    layer = np.arange(new.num_layers)[:, None, None]
    rank = np.arange(new.num_ranks)[None, :, None]
    filled = by_rank >= 0
    return int((filled & ~held[layer, rank, np.maximum(by_rank, 0)]).sum())


def bytes_moved(old: ExpertLocation, new: ExpertLocation, expert_nbytes: int) -> int:
    """slots_moved(old, new) * expert_nbytes."""
    return slots_moved(old, new) * expert_nbytes


def _held(location: ExpertLocation, num_ranks: int, num_experts: int) -> np.ndarray:
    """[L, num_ranks, E] bool: rank holds expert (ranks beyond the placement hold nothing)."""
    held = np.zeros((location.num_layers, num_ranks, num_experts + 1), dtype=bool)
    by_rank = location.by_rank()[:, : min(num_ranks, location.num_ranks)]
    layer = np.arange(location.num_layers)[:, None, None]
    rank = np.arange(by_rank.shape[1])[None, :, None]
    held[layer, rank, np.where(by_rank >= 0, by_rank, num_experts)] = True
    return held[:, :, :num_experts]


def replicas_sharing_node(location: ExpertLocation, rank_nodes: Mapping[int, object]) -> int:
    """Replicas that sit on a node already holding another replica of the same expert (all layers)."""
    nodes = {node: i for i, node in enumerate(sorted(set(rank_nodes.values()), key=str))}
    node_of_rank = np.array([nodes.get(rank_nodes.get(r), -1) for r in range(location.num_ranks)], dtype=np.int64)
    if (node_of_rank < 0).any():
        missing = int(np.nonzero(node_of_rank < 0)[0][0])
        raise PlacementError(f"rank_nodes has no node for rank {missing}")
    node_of_slot = np.repeat(node_of_rank, location.slots_per_rank)
    filled = location.phy2log >= 0
    layer = np.broadcast_to(np.arange(location.num_layers)[:, None], filled.shape)
    key = (layer[filled] * len(nodes) + node_of_slot[None, :].repeat(location.num_layers, 0)[filled])
    key = key * location.num_experts + location.phy2log[filled]
    _, counts = np.unique(key, return_counts=True)
    return int((counts - 1).sum())


def copies_on_same_rank(location: ExpertLocation) -> int:
    """Copies beyond the first of an expert on one rank (DeepSeek's global policy can make them)."""
    ordered = np.sort(location.by_rank(), axis=2)
    return int(((ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, 1:] >= 0)).sum())


def experts_without_live_replica(location: ExpertLocation, live_ranks: Iterable[int]) -> list[tuple[int, int]]:
    """(layer, expert) pairs with no replica on a live rank: the ones to restore from backup or disk."""
    held = _held(location, location.num_ranks, location.num_experts)
    live = sorted(r for r in set(live_ranks) if 0 <= r < location.num_ranks)
    covered = held[:, live].any(axis=1) if live else np.zeros((location.num_layers, location.num_experts), bool)
    return [(int(layer), int(expert)) for layer, expert in zip(*np.nonzero(~covered), strict=True)]
