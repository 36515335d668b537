"""Restore placements computed ahead of a loss: for each likely loss of an epoch (every single
member, every node's members), the slots `restore_placement` would fill, so that recovery after
that loss looks them up instead of computing them while the group waits.

Pure: `likely_losses` names the losses, `restores_ahead` computes their fills (run off the
control thread: a process of its own, control/epochs/restore_ahead.py), `apply_fills` turns a
fill back into the placement. A fill is [K, 3] int64 rows (layer, slot, expert): the slots the
restore placement changes in the held placement (the lost experts' new homes), a few per layer,
where the placement itself is [L, S].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from elastic_ep.errors import PlacementError
from elastic_ep.placement.location import ExpertLocation, count_replicas
from elastic_ep.placement.restore import restore_placement

Loss = frozenset[int]


def likely_losses(members: Iterable[int], rank_nodes: Mapping[int, object]) -> list[Loss]:
    """Every single member, then every node's members where a node holds more than one
    (ascending ranks; duplicates once)."""
    members = sorted(set(members))
    by_node: dict[object, list[int]] = {}
    for r in members:
        by_node.setdefault(rank_nodes.get(r), []).append(r)
    losses = [frozenset([r]) for r in members]
    losses += [frozenset(ranks) for ranks in by_node.values() if len(ranks) > 1]
    return list(dict.fromkeys(losses))


def held_after(location: ExpertLocation, members: Iterable[int], loss: Loss) -> ExpertLocation:
    """What the members outside `loss` hold of `location` once `loss` is gone."""
    return location.restricted_to([r for r in members if r not in loss])


def fills(held: ExpertLocation, restored: ExpertLocation) -> np.ndarray:
    """[K, 3] (layer, slot, expert) of the slots `restored` sets differently from `held`."""
    layers, slots = np.nonzero(restored.phy2log != held.phy2log)
    return np.stack([layers, slots, restored.phy2log[layers, slots]], axis=1).astype(np.int64)


def apply_fills(held: ExpertLocation, fill: np.ndarray) -> ExpertLocation:
    """`held` with the slots of `fill` [K, 3] (layer, slot, expert) set."""
    phy2log = held.phy2log.copy()
    phy2log[fill[:, 0], fill[:, 1]] = fill[:, 2]
    return ExpertLocation.from_phy2log(phy2log, held.slots_per_rank, held.num_experts)


def restores_ahead(
    phy2log: np.ndarray,
    slots_per_rank: int,
    num_experts: int,
    load: np.ndarray,
    members: list[int],
    rank_nodes: Mapping[int, object],
    backup_nodes: Mapping[tuple[int, int], object],
    losses: Iterable[Loss],
    wanted: Callable[[], bool] = lambda: True,
) -> dict[Loss, np.ndarray | None]:
    """For each loss, the fill of `restore_placement` over the members outside it (None where
    they cannot hold every expert). Stops early, returning what it has, once `wanted()` is false
    (the epoch it was for is over).

    phy2log: [L, S] the epoch's placement; load: [L, E] the load the restores are for.
    A loss that leaves every expert a copy on the other members (most, where the redundancy
    gives each expert several) fills nothing, and is counted, not restored: the restore of such
    a loss keeps every slot (it fills only an expert without a copy), and building its two
    placements was most of the ~10 ms a loss took at 1,024 ranks.
    """
    location = ExpertLocation.from_phy2log(phy2log, slots_per_rank, num_experts)
    by_rank = location.by_rank()  # [L, R, s]
    placed = sorted({r for r in members if 0 <= r < location.num_ranks})  # the ranks a restore holds on
    on_members = _copies(by_rank[:, placed], num_experts)  # [L, E]
    none = np.zeros((0, 3), dtype=np.int64)
    out: dict[Loss, np.ndarray | None] = {}
    for loss in losses:
        if not wanted():
            break
        lost = [r for r in placed if r in loss]
        enough_slots = (len(placed) - len(lost)) * slots_per_rank >= num_experts
        if enough_slots and (on_members > _copies(by_rank[:, lost], num_experts)).all():
            out[loss] = none
            continue
        held = held_after(location, members, loss)
        try:
            restored = restore_placement(held, load, [r for r in members if r not in loss], rank_nodes, backup_nodes)
        except PlacementError:
            out[loss] = None
            continue
        out[loss] = fills(held, restored)
    return out


def _copies(slots: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E]: the copies of each expert among `slots` [L, ...] (-1 slots not counted)."""
    flat = slots.reshape(slots.shape[0], -1)
    return count_replicas(flat, num_experts)
