"""The project's own placement policy: live ranks only, minimal movement, failure domains, speeds.

One function serves every membership change: the first placement (no current placement), a
failure (some ranks dead), scale-up (new ranks with empty slots), scale-down (ranks removed),
and periodic rebalancing (same ranks, new load).

Steps, each vectorized over the layers:
1. replica counts: keep the live replicas; an expert with none gets one; fit the total to the
   live slots (remove copies where the load per copy stays smallest, add where it is largest);
   trade a copy between experts only when that shrinks the busiest copy by more than the
   tolerance;
2. evict the surplus copies, preferring copies that share a node with another copy of the same
   expert, then copies on the busiest ranks;
3. place the missing copies, heaviest first, on the rank that finishes earliest (load / speed),
   never twice on a rank, on a node without a copy of that expert wherever one has room (where
   that leaves a layer more than SPREAD_COST slower than a placement allowing shared nodes, the
   latter is taken: under extreme skew strict spreading can cost 20% of a layer's balance);
4. swap copies between the slowest rank and the lightest ranks while that lowers the slowest
   rank's time and the slowest rank is more than the tolerance above the best possible time
   (total load / total speed, or the busiest copy on the fastest rank). Swaps never add node
   sharing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from elastic_ep.errors import PlacementError
from elastic_ep.placement.location import EMPTY, ExpertLocation

DEFAULT_MOVEMENT_TOLERANCE = 0.01
# The slowest rank tries swaps with this many of the lightest ranks: all 32 of a 32-rank layout
# took 3x the time for 0.0003 more balancedness.
SWAP_PARTNERS = 8
# A first placement moves nothing, so it refines until within 0.1% of the ideal.
SCRATCH_TOLERANCE = 0.001
# Spreading an expert's copies over nodes may cost a layer at most this fraction of its best time.
SPREAD_COST = 0.02


def fault_aware_placement(
    load,
    live_ranks: Iterable[int],
    rank_nodes: Mapping[int, object],
    rank_speeds: Mapping[int, float] | None,
    slots_per_rank: int,
    num_ranks: int,
    current: ExpertLocation | None = None,
    movement_tolerance: float = DEFAULT_MOVEMENT_TOLERANCE,
) -> ExpertLocation:
    """A placement over `live_ranks` that keeps `current` where balance allows.

    load: [L, E] tokens per logical expert (array-like, numpy or CPU torch).
    live_ranks: rank indices in [0, num_ranks) that will serve; other ranks' slots come out empty.
    rank_nodes: rank -> node (failure domain), needed for every live rank.
    rank_speeds: rank -> relative speed (1.0 where missing); a rank gets load in proportion to it.
    current: the placement in use (None for the first one). It may have fewer ranks (scale-up) or
        more (scale-down); its copies on ranks outside `live_ranks` are treated as lost.
    movement_tolerance: fraction of the ideal time a layer may stay above it before copies are
        moved for balance, and the margin a replica trade between experts must win by; 0 moves
        whenever it helps. A first placement (`current` None) uses SCRATCH_TOLERANCE.
    Returns an ExpertLocation over `num_ranks` ranks of `slots_per_rank` slots. Raises
    PlacementError when the live ranks cannot hold every expert (naming how many slots are missing).
    """
    weight = _load_matrix(load)
    num_layers, num_experts = weight.shape
    live, node_of, speed = _live_ranks(live_ranks, rank_nodes, rank_speeds, num_ranks)
    num_live = len(live)
    if slots_per_rank < 1:
        raise PlacementError(f"slots_per_rank must be at least 1, got {slots_per_rank}")
    if num_live * slots_per_rank < num_experts:
        missing = num_experts - num_live * slots_per_rank
        raise PlacementError(
            f"{num_live} live ranks x {slots_per_rank} slots = {num_live * slots_per_rank} slots cannot hold "
            f"{num_experts} experts: {missing} slots missing; add ranks or slots per rank"
        )
    grid = np.full((num_layers, num_live, slots_per_rank), EMPTY, dtype=np.int64)
    tolerance = SCRATCH_TOLERANCE
    if current is not None:
        _check_current(current, num_layers, num_experts, slots_per_rank)
        old = current.by_rank()
        kept = [i for i, r in enumerate(live) if r < current.num_ranks]
        grid[:, kept] = old[:, live[kept]]
        grid = _drop_duplicates(grid)
        tolerance = movement_tolerance

    total = min(num_live * slots_per_rank, num_experts * num_live)
    counts = _target_counts(weight, _counts(grid, num_experts), num_live, total, tolerance)
    item = np.concatenate([weight / counts, np.zeros((num_layers, 1))], axis=1)
    # No placement beats the even spread of load, nor the busiest copy on the fastest rank.
    best_time = np.maximum(weight.sum(1) / speed.sum(), item.max(1) / speed.max())
    target_time = (1 + tolerance) * best_time
    state = _State(grid, item, node_of, speed, num_experts)
    state.evict_surplus(counts)
    evicted = state.grid.copy()
    # Larger than any finishing time: a node without the expert always wins when it has room.
    state.place_missing(counts, 2 * item.sum(1) / speed.min() + 1)
    state.refine(target_time)
    spread_time = state.rank_times(state.rows).max(1)

    # Where spreading copies over nodes cost more than SPREAD_COST of the best time, place again
    # letting a copy share a node when that wins more than SPREAD_COST, and keep the faster one.
    poor = np.nonzero(spread_time > (1 + SPREAD_COST) * best_time)[0]
    if len(poor):
        retry = _State(evicted[poor], item[poor], node_of, speed, num_experts)
        retry.place_missing(counts[poor], SPREAD_COST * best_time[poor])
        retry.refine(target_time[poor])
        better = retry.rank_times(retry.rows).max(1) * (1 + SPREAD_COST) < spread_time[poor]
        state.grid[poor[better]] = retry.grid[better]

    full = np.full((num_layers, num_ranks, slots_per_rank), EMPTY, dtype=np.int64)
    full[:, live] = state.grid
    return ExpertLocation.from_phy2log(full.reshape(num_layers, -1), slots_per_rank, num_experts)


def _load_matrix(load) -> np.ndarray:
    w = np.asarray(load, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] == 0:
        raise PlacementError(f"load must be [layers, experts], got shape {list(w.shape)}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise PlacementError("load must hold finite, non-negative token counts")
    return w


def _live_ranks(live_ranks, rank_nodes, rank_speeds, num_ranks):
    live = np.array(sorted(set(int(r) for r in live_ranks)), dtype=np.int64)
    if len(live) == 0:
        raise PlacementError("no live ranks: at least one rank must serve")
    if live[0] < 0 or live[-1] >= num_ranks:
        raise PlacementError(f"live ranks must lie in 0..{num_ranks - 1}, got {live.tolist()}")
    missing = [int(r) for r in live if r not in rank_nodes]
    if missing:
        raise PlacementError(f"rank_nodes names no node for live ranks {missing}")
    nodes = {node: i for i, node in enumerate(dict.fromkeys(rank_nodes[int(r)] for r in live))}
    node_of = np.array([nodes[rank_nodes[int(r)]] for r in live], dtype=np.int64)
    speeds = rank_speeds or {}
    speed = np.array([float(speeds.get(int(r), 1.0)) for r in live])
    if not (np.isfinite(speed) & (speed > 0)).all():
        raise PlacementError(f"rank speeds must be positive numbers, got {dict(speeds)}")
    return live, node_of, speed


def _check_current(current: ExpertLocation, num_layers: int, num_experts: int, slots_per_rank: int) -> None:
    if current.num_layers != num_layers or current.num_experts != num_experts:
        raise PlacementError(
            f"current placement is {current.num_layers} layers x {current.num_experts} experts, "
            f"the load is {num_layers} x {num_experts}"
        )
    if current.slots_per_rank != slots_per_rank:
        raise PlacementError(
            f"current placement has {current.slots_per_rank} slots per rank, asked for {slots_per_rank}; "
            "slot geometry cannot change in place"
        )


def _drop_duplicates(grid: np.ndarray) -> np.ndarray:
    """Empty the second and later copies of an expert on one rank. grid: [L, R, S]."""
    order = np.argsort(grid, axis=2, kind="stable")
    ordered = np.take_along_axis(grid, order, axis=2)
    dup = np.zeros_like(grid, dtype=bool)
    dup[:, :, 1:] = (ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, 1:] >= 0)
    out = grid.copy()
    np.put_along_axis(out, order, np.where(dup, EMPTY, ordered), axis=2)
    return out


def _counts(grid: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] copies of each expert in grid [L, R, S]."""
    num_layers = grid.shape[0]
    flat = grid.reshape(num_layers, -1)
    key = (np.arange(num_layers)[:, None] * (num_experts + 1) + np.where(flat < 0, num_experts, flat)).ravel()
    counts = np.bincount(key, minlength=num_layers * (num_experts + 1)).reshape(num_layers, -1)
    return counts[:, :num_experts]


def _target_counts(
    weight: np.ndarray, kept: np.ndarray, max_per_expert: int, total: int, tolerance: float
) -> np.ndarray:
    """[L, E] copies per expert summing to `total` per layer, starting from the kept copies."""
    counts = np.maximum(kept, 1)
    rows = np.arange(weight.shape[0])

    def lightest_removal(c):
        return np.where(c >= 2, weight / np.maximum(c - 1, 1), np.inf)

    def heaviest_copy(c):
        return np.where(c < max_per_expert, weight / c, -np.inf)

    while (over := counts.sum(1) > total).any():
        donor = lightest_removal(counts).argmin(1)
        counts[rows[over], donor[over]] -= 1
    while (under := counts.sum(1) < total).any():
        receiver = heaviest_copy(counts).argmax(1)
        counts[rows[under], receiver[under]] += 1
    for _ in range(total):
        heavy = heaviest_copy(counts)
        receiver = heavy.argmax(1)
        after = lightest_removal(counts)
        after[rows, receiver] = np.inf
        donor = after.argmin(1)
        trade = heavy[rows, receiver] > (1 + tolerance) * after[rows, donor]
        if not trade.any():
            break
        counts[rows[trade], receiver[trade]] += 1
        counts[rows[trade], donor[trade]] -= 1
    return counts


class _State:
    """The placement being built over the live ranks, with the indexes kept in step with it.

    grid: [L, R, S] expert per slot; item: [L, E + 1] load per copy (column E = empty slot, 0).
    """

    def __init__(self, grid, item, node_of, speed, num_experts):
        self.grid = grid
        self.item = item
        self.node_of = node_of
        self.speed = speed
        self.num_experts = num_experts
        num_layers, num_ranks, _ = grid.shape
        self.rows = np.arange(num_layers)
        e = np.where(grid < 0, num_experts, grid)
        layer = self.rows[:, None, None]
        self.has = np.zeros((num_layers, num_ranks, num_experts + 1), dtype=bool)
        self.has[layer, np.arange(num_ranks)[None, :, None], e] = True
        self.node_cnt = np.zeros((num_layers, int(node_of.max()) + 1, num_experts + 1), dtype=np.int64)
        np.add.at(self.node_cnt, (np.broadcast_to(layer, e.shape), node_of[None, :, None], e), 1)
        self._clear_empty_column()
        self.free = (grid < 0).sum(2)
        self.rank_load = np.take_along_axis(item, e.reshape(num_layers, -1), 1).reshape(e.shape).sum(2)

    def _clear_empty_column(self):
        self.has[:, :, self.num_experts] = False
        self.node_cnt[:, :, self.num_experts] = 0

    def _ext(self, experts):
        return np.where(experts < 0, self.num_experts, experts)

    def _set(self, layers, ranks, slots, experts):
        """Put `experts` (-1 = clear) into distinct slots; a rank never gets an expert it holds."""
        old = self._ext(self.grid[layers, ranks, slots])
        new = self._ext(experts)
        nodes = self.node_of[ranks]
        self.has[layers, ranks, old] = False
        np.subtract.at(self.node_cnt, (layers, nodes, old), 1)
        np.add.at(self.rank_load, (layers, ranks), self.item[layers, new] - self.item[layers, old])
        self.grid[layers, ranks, slots] = experts
        self.has[layers, ranks, new] = True
        np.add.at(self.node_cnt, (layers, nodes, new), 1)
        np.add.at(self.free, (layers, ranks), (experts < 0).astype(np.int64) - (old == self.num_experts))
        self._clear_empty_column()

    def evict_surplus(self, counts: np.ndarray) -> None:
        surplus = _counts(self.grid, self.num_experts) - counts
        layer, rank, slot = np.nonzero(self.grid >= 0)
        expert = self.grid[layer, rank, slot]
        keep_last = surplus[layer, expert] <= 0
        layer, rank, slot, expert = layer[~keep_last], rank[~keep_last], slot[~keep_last], expert[~keep_last]
        if len(layer) == 0:
            return
        time = self.rank_load[layer, rank] / self.speed[rank]
        shares = self.node_cnt[layer, self.node_of[rank], expert] > 1
        priority = shares * (time.max() + 1) + time
        order = np.lexsort((-priority, expert, layer))
        layer, rank, slot, expert = layer[order], rank[order], slot[order], expert[order]
        first = np.ones(len(layer), dtype=bool)
        first[1:] = (layer[1:] != layer[:-1]) | (expert[1:] != expert[:-1])
        start = np.maximum.accumulate(np.where(first, np.arange(len(layer)), 0))
        evict = np.arange(len(layer)) - start < surplus[layer, expert]
        self._set(layer[evict], rank[evict], slot[evict], np.full(int(evict.sum()), EMPTY))

    def place_missing(self, counts: np.ndarray, node_penalty: np.ndarray) -> None:
        """Place the copies `counts` [L, E] asks for beyond those in the grid, heaviest first.

        node_penalty: [L] time added to a rank whose node already holds the expert.
        """
        need = counts - _counts(self.grid, self.num_experts)
        per_layer = [np.repeat(np.arange(self.num_experts), need[row]) for row in self.rows]
        width = max((len(p) for p in per_layer), default=0)
        queue = np.full((len(self.rows), width), EMPTY, dtype=np.int64)
        for row, experts in enumerate(per_layer):
            queue[row, : len(experts)] = experts[np.argsort(-self.item[row, experts], kind="stable")]
        penalty = node_penalty[:, None]
        for i in range(width):
            expert = queue[:, i]
            active = expert >= 0
            e = self._ext(expert)
            node_has = self.node_cnt[self.rows, :, e][:, self.node_of] > 0
            score = (self.rank_load + self.item[self.rows, e][:, None]) / self.speed + node_has * penalty
            score[self.has[self.rows, :, e] | (self.free == 0)] = np.inf
            rank = score.argmin(1)
            ok = active & np.isfinite(score[self.rows, rank])
            slot = (self.grid[self.rows, rank] < 0).argmax(1)
            self._set(self.rows[ok], rank[ok], slot[ok], expert[ok])
            for row in np.nonzero(active & ~ok)[0]:
                self._place_by_swap(int(row), int(expert[row]))

    def _place_by_swap(self, row: int, expert: int) -> None:
        """Every free slot is on a rank already holding `expert`: make room on another rank.

        Moves some copy x from a full rank without `expert` into the free slot (x is not on that
        rank, which always exists), and puts `expert` where x was.
        """
        grid = self.grid[row]
        free_rank, free_slot = (int(i[0]) for i in np.nonzero(grid < 0))
        for other in np.nonzero(~self.has[row, :, expert])[0]:
            for slot in range(grid.shape[1]):
                x = int(grid[other, slot])
                if x >= 0 and not self.has[row, free_rank, x]:
                    one = np.array([row])
                    self._set(one, np.array([other]), np.array([slot]), np.array([EMPTY]))
                    self._set(one, np.array([free_rank]), np.array([free_slot]), np.array([x]))
                    self._set(one, np.array([other]), np.array([slot]), np.array([expert]))
                    return
        raise PlacementError(f"layer {row}: no rank can take another copy of expert {expert}")

    def rank_times(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), R] load / speed of each rank.

        Summed afresh in slot order: equal placements give bit-equal times, so a rerun on an
        unchanged placement picks the same slowest rank and finds nothing to move.
        """
        copies = self._ext(self.grid[rows]).reshape(len(rows), -1)
        loads = np.take_along_axis(self.item[rows], copies, 1).reshape(len(rows), self.grid.shape[1], -1).sum(2)
        return loads / self.speed

    def refine(self, target_time: np.ndarray) -> None:
        """Swap copies between each layer's slowest rank and its lightest ranks. target_time: [L]."""
        _, num_ranks, num_slots = self.grid.shape
        partners = min(num_ranks, SWAP_PARTNERS)
        slot_of_column = np.tile(np.arange(num_slots), partners)
        rows = self.rows
        for _ in range(2 * num_ranks * num_slots):
            time = self.rank_times(rows)
            r1 = time.argmax(1)
            t1 = time[np.arange(len(rows)), r1]
            keep = t1 > target_time[rows]
            rows, time, r1, t1 = rows[keep], time[keep], r1[keep], t1[keep]
            if len(rows) == 0:
                return
            r2 = np.argsort(time, axis=1)[:, :partners].repeat(num_slots, axis=1)
            e1 = self._ext(self.grid[rows, r1])
            e2 = self._ext(self.grid[rows[:, None], r2, slot_of_column[None, :]])
            delta = self.item[rows[:, None], e1][:, :, None] - self.item[rows[:, None], e2][:, None, :]
            t1_after = t1[:, None, None] - delta / self.speed[r1][:, None, None]
            t2_after = np.take_along_axis(time, r2, 1)[:, None, :] + delta / self.speed[r2][:, None, :]
            gain = t1[:, None, None] - np.maximum(t1_after, t2_after)
            lr = rows[:, None, None]
            valid = (delta > 0) & (r2 != r1[:, None])[:, None, :] & (e1 < self.num_experts)[:, :, None]
            valid &= ~self.has[lr, r2[:, None, :], e1[:, :, None]]
            valid &= ~self.has[rows[:, None], r1[:, None], e2][:, None, :]
            n1 = self.node_of[r1][:, None, None]
            n2 = self.node_of[r2][:, None, :]
            ee1, ee2 = e1[:, :, None], e2[:, None, :]
            sharing_change = (
                (self.node_cnt[lr, n2, ee1] >= 1).astype(np.int64)
                - (self.node_cnt[lr, n1, ee1] >= 2)
                + (self.node_cnt[lr, n1, ee2] >= 1)
                - (self.node_cnt[lr, n2, ee2] >= 2)
            )
            valid &= (n1 == n2) | (sharing_change <= 0)
            gain = np.where(valid, gain, -np.inf).reshape(len(rows), -1)
            best = gain.argmax(1)
            swap = gain[np.arange(len(rows)), best] > 1e-9 * np.maximum(t1, 1e-30)
            if not swap.any():
                return
            rows, r1, r2, best = rows[swap], r1[swap], r2[swap], best[swap]
            slot1, column = np.divmod(best, partners * num_slots)
            rank2, slot2 = r2[np.arange(len(rows)), column], slot_of_column[column]
            expert1 = self.grid[rows, r1, slot1].copy()
            expert2 = self.grid[rows, rank2, slot2].copy()
            self._set(rows, r1, slot1, np.full(len(rows), EMPTY))
            self._set(rows, rank2, slot2, expert1)
            self._set(rows, r1, slot1, expert2)
