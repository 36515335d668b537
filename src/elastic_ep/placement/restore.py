"""Recovery in two placements: the one an epoch serves with right after a loss, and the steps from
it to a balanced one, taken later in the background.

`restore_placement` keeps every expert where it is and gives each expert that lost every replica
one slot: an empty slot, else a slot whose expert keeps another replica. Only those slots are
filled before the group serves again, so the pause after a loss costs the lost experts' bytes,
not a re-balance. `step_towards` then walks from the placement in use to a balanced target a few
slots at a time, every intermediate placement serving every expert, so a background rebalance
moves experts between steps without a long pause.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from elastic_ep.errors import PlacementError
from elastic_ep.placement.location import EMPTY, ExpertLocation


def restore_placement(
    held: ExpertLocation,
    load,
    holding_ranks: Iterable[int],
    rank_nodes: Mapping[int, object],
    backup_nodes: Mapping[tuple[int, int], object] | None = None,
) -> ExpertLocation:
    """The placement to serve with at once: `held` plus one replica of every expert it lacks.

    held: what the ranks hold now (the placement in use on the surviving ranks, empty slots on
        new or restarted ranks and on slots that failed verification).
    load: [L, E] tokens per logical expert.
    holding_ranks: the ranks that hold experts in the new epoch; every other rank's slots end empty.
    rank_nodes: rank -> node (failure domain) of every holding rank.
    backup_nodes: (layer, expert) -> node whose host-memory backup holds that expert.
    Each lost expert (heaviest first) takes the slot that, in order: sits on its backup's node
    (a local read), is on the rank with the fewest restores so far (ranks restore in parallel),
    is empty, or else holds the copy whose loss leaves the least load per remaining copy, on the
    least loaded rank (its copies' load per copy summed over its slots in slot order), then the
    lowest rank and slot. Every other slot is as in `held`.
    Returns an ExpertLocation of held's shape. Raises PlacementError when the holding ranks have
    fewer slots than there are experts.

    Vectorized over the candidate slots: one pass of numpy over the [H, s] slots of the H
    holding ranks per lost expert, keys compared in order (each narrows the candidates to its
    minimum), instead of a tuple per candidate.
    """
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
    hold = np.asarray(holding, dtype=np.int64)
    codes: dict[object, int] = {}
    node_of = np.array([codes.setdefault(rank_nodes.get(r), len(codes)) for r in holding])  # [H]
    restores = np.zeros((len(holding), 1), dtype=np.int64)  # [H, 1]
    for layer in range(num_layers):
        sub = grid[layer, hold]  # [H, s], a copy written back below
        wl = w[layer]
        count = np.bincount(sub[sub >= 0], minlength=num_experts)
        lost = np.nonzero(count == 0)[0]
        if not len(lost):
            continue
        for expert in lost[np.argsort(-wl[lost], kind="stable")].tolist():
            filled = sub >= 0
            x = np.where(filled, sub, 0)
            copies = count[x]  # [H, s]
            per_copy = np.where(count > 0, wl / np.maximum(count, 1), 0.0)
            rank_load = np.where(filled, per_copy[x], 0.0).sum(axis=1, keepdims=True)  # [H, 1]
            donor = np.where(filled, wl[x] / np.maximum(copies - 1, 1), 0.0)
            candidate = ~filled | (copies >= 2)
            home = backup_nodes.get((layer, expert))
            away = (node_of != codes.get(home, -1))[:, None] if home is not None else np.zeros((len(hold), 1), bool)
            for key in (away, restores, filled, donor, rank_load):  # [H, 1] per rank or [H, s] per slot
                if key.shape[1] == 1:
                    per_rank = key[:, 0]
                    candidate &= (per_rank == per_rank[candidate.any(axis=1)].min())[:, None]
                else:
                    candidate &= key == key[candidate].min()
            h, j = divmod(int(np.argmax(candidate)), s)
            if sub[h, j] >= 0:
                count[sub[h, j]] -= 1
            sub[h, j] = expert
            count[expert] += 1
            restores[h] += 1
        grid[layer, hold] = sub
    return ExpertLocation.from_phy2log(grid.reshape(num_layers, -1), s, num_experts)


def step_towards(current: ExpertLocation, target: ExpertLocation, max_slots: int, load) -> ExpertLocation:
    """The next placement on the way from `current` to `target`: at most `max_slots` slots set to
    their target expert (more only where moves depend on each other), every expert still held by
    some slot and none twice on a rank. Slots that give the hottest expert (load per copy in
    `current`) a new copy go first. Returns `target` when at most `max_slots` slots differ.

    current, target: placements of the same shape, both serving every expert.
    load: [L, E] tokens per logical expert.

    Each slot taken brings the moves it cannot go without (`_take`), worked out from that slot
    alone on one working copy of the slot map and its [L, E] copy counts: the cost grows with the
    slots moved, not with the placement's size per slot (a copy and a check of the whole map per
    slot considered took the control thread for minutes at 1,024 ranks).
    """
    if current.phy2log.shape != target.phy2log.shape or current.slots_per_rank != target.slots_per_rank:
        raise PlacementError(f"cannot step from a {list(current.phy2log.shape)} placement to a "
                             f"{list(target.phy2log.shape)} one")
    limit = max(max_slots, 1)
    diff = np.argwhere(current.phy2log != target.phy2log)  # [n, 2] (layer, slot)
    if len(diff) <= limit:
        return target
    w = np.asarray(load, dtype=np.float64)
    per_copy = w / np.maximum(current.logcnt, 1)
    wanted = target.phy2log[diff[:, 0], diff[:, 1]]
    hotness = np.where(wanted >= 0, per_copy[diff[:, 0], np.maximum(wanted, 0)], 0.0)
    work = current.phy2log.copy()
    count = current.logcnt.astype(np.int64)  # [L, E] copies in `work`
    taken = np.zeros(work.shape, dtype=bool)
    moved = 0
    for layer, slot in diff[np.argsort(-hotness, kind="stable")].tolist():
        if moved >= limit:
            break
        if not taken[layer, slot]:
            moved += _take(layer, slot, work, count, taken, target.phy2log, current.slots_per_rank)
    return ExpertLocation.from_phy2log(work, current.slots_per_rank, current.num_experts)


def _take(layer: int, slot: int, work: np.ndarray, count: np.ndarray, taken: np.ndarray, target: np.ndarray,
          s: int) -> int:
    """Set `slot` of `layer` in `work` to its target expert, with the moves it cannot go without: a
    slot of the target for an expert it leaves with no copy, and the old slot of an expert it moves
    within a rank; each of those brings its own. Updates `count` and `taken`; returns the slots set."""
    todo, n = [(layer, slot)], 0
    while todo:
        layer, slot = todo.pop()
        if taken[layer, slot]:
            continue
        taken[layer, slot] = True
        n += 1
        old, new = int(work[layer, slot]), int(target[layer, slot])
        work[layer, slot] = new
        if old >= 0:
            count[layer, old] -= 1
            if count[layer, old] == 0:  # the target holds it somewhere not yet taken
                todo.append((layer, next(int(x) for x in np.flatnonzero(target[layer] == old)
                                         if not taken[layer, x])))
        if new >= 0:
            count[layer, new] += 1
            first = slot - slot % s
            todo.extend((layer, first + k) for k in np.flatnonzero(work[layer, first:first + s] == new).tolist()
                        if first + k != slot and not taken[layer, first + k])
    return n
