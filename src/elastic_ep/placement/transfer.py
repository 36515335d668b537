"""Transfer plan: where each slot of a new placement gets its expert's weights from.

Sources in order of preference:
  keep   - the slot already holds that expert;
  local  - another slot of the same rank holds it (a copy on the device);
  peer   - a live rank holds it: same node first, then the sender with the fewest bytes so far;
  backup - the host-memory backup on a node (what the caller says is still reachable);
  disk   - the checkpoint.
Every source refers to the OLD placement: an executor reads all its sources before it overwrites
any slot (or double-buffers). A rank outside `live_ranks` is never a source.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from elastic_ep.errors import PlacementError
from elastic_ep.placement.location import ExpertLocation

SOURCE_KINDS = ("keep", "local", "peer", "backup", "disk")


@dataclass(frozen=True)
class Transfer:
    """One destination slot of the new placement and where its weights come from.

    dst_slot / src_slot are global slot indices (rank * slots_per_rank + j) of the new / old
    placement; src_rank and src_slot are -1 for backup and disk; src_node is set for backup only.
    """

    layer: int
    expert: int
    dst_rank: int
    dst_slot: int
    source: str
    src_rank: int = -1
    src_slot: int = -1
    src_node: object = None


@dataclass(frozen=True)
class TransferPlan:
    """Every filled slot of the new placement on a live rank, with its source and the byte totals.

    moved: the slots that copy anything (every source but keep), in (layer, dst_slot) order.
    kept: [K, 5] int64 rows (layer, expert, dst_rank, dst_slot, src_slot) of the slots that keep
        their expert: most slots of most epochs, held as one array rather than an object each.
    """

    moved: tuple[Transfer, ...]
    kept: np.ndarray
    bytes_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def transfers(self) -> list[Transfer]:
        """Every slot's transfer, keeps included, in (layer, dst_slot) order."""
        keeps = [Transfer(layer, expert, rank, dst, "keep", rank, src) for layer, expert, rank, dst, src
                 in self.kept.tolist()]
        return sorted(keeps + list(self.moved), key=lambda t: (t.layer, t.dst_slot))

    @property
    def bytes_moved(self) -> int:
        """Bytes that cross the wire or come from storage: peer + backup + disk."""
        return sum(self.bytes_by_source[k] for k in ("peer", "backup", "disk"))

    def moves(self) -> list[Transfer]:
        """The transfers that copy anything (all but keep)."""
        return list(self.moved)


def plan_transfers(
    old: ExpertLocation,
    new: ExpertLocation,
    live_ranks: Iterable[int],
    rank_nodes: Mapping[int, object],
    backup: Mapping[tuple[int, int], object] | None,
    expert_nbytes: int,
) -> TransferPlan:
    """The per-slot sources that turn `old` into `new`.

    old: the placement whose slots hold weights now (ranks beyond old.num_ranks hold nothing).
    new: the placement to reach; its filled slots must be on live ranks.
    live_ranks: ranks alive now; a rank being drained for scale-down is live (it can send) even
        though `new` leaves it empty.
    rank_nodes: rank -> node, for every live rank and every rank of `new`.
    backup: (layer, expert) -> node holding a reachable host-memory copy; None or missing = none.
    expert_nbytes: bytes of one expert's weights (one slot).
    The kept slots are found with numpy over [L, S]; only the slots that change are planned one
    by one (a peer source depends on the bytes each sender has taken on so far).
    """
    if old.num_layers != new.num_layers or old.num_experts != new.num_experts:
        raise PlacementError(
            f"old placement is {old.num_layers} x {old.num_experts} (layers x experts), "
            f"new is {new.num_layers} x {new.num_experts}"
        )
    live = set(int(r) for r in live_ranks)
    new_by_rank = new.by_rank()
    occupied_dead = [r for r in range(new.num_ranks) if r not in live and (new_by_rank[:, r] >= 0).any()]
    if occupied_dead:
        raise PlacementError(f"new placement puts experts on ranks {occupied_dead}, which are not live")
    backup = backup or {}
    new_spr, old_spr = new.slots_per_rank, old.slots_per_rank
    p = new.phy2log  # [L, S]
    slot = np.arange(p.shape[1])
    dst_ranks, j = slot // new_spr, slot % new_spr
    at = dst_ranks * old_spr + j  # the same slot of the same rank in `old`
    same = (j < old_spr) & (at < old.phy2log.shape[1])
    held_there = np.full(p.shape, -2, dtype=np.int64)
    held_there[:, same] = old.phy2log[:, at[same]]
    keep = (p >= 0) & (held_there == p)
    layers, dst = np.nonzero(keep)
    kept = np.stack([layers, p[layers, dst], dst_ranks[dst], dst, at[dst]], axis=1).astype(np.int64)
    sent_bytes: dict[int, int] = defaultdict(int)
    totals = dict.fromkeys(SOURCE_KINDS, 0)
    totals["keep"] = len(kept) * expert_nbytes
    moved = []
    todo = np.argwhere((p >= 0) & ~keep)  # [M, 2] (layer, dst slot), layer by layer
    bounds = np.searchsorted(todo[:, 0], np.arange(p.shape[0] + 1)).tolist()
    for layer in range(p.shape[0]):
        dst_slots = todo[bounds[layer] : bounds[layer + 1], 1]
        if not len(dst_slots):
            continue
        experts = p[layer, dst_slots]
        holders_of = _slots_of(old.phy2log[layer], experts)
        for dst_slot, expert in zip(dst_slots.tolist(), experts.tolist(), strict=True):
            holders = [(s // old_spr, s) for s in holders_of.get(expert, ()) if s // old_spr in live]
            t = _source(layer, expert, dst_slot // new_spr, dst_slot, holders, rank_nodes, backup, sent_bytes)
            if t.source == "peer":
                sent_bytes[t.src_rank] += expert_nbytes
            totals[t.source] += expert_nbytes
            moved.append(t)
    return TransferPlan(tuple(moved), kept, totals)


def _slots_of(row: np.ndarray, experts: np.ndarray) -> dict[int, list[int]]:
    """expert -> its slots in ascending order in one layer's phy2log row [S], for `experts` only:
    what a transfer plan reads of log2phy, without building [L, E, R] for every expert."""
    slots = np.flatnonzero(np.isin(row, experts))  # ascending
    out: dict[int, list[int]] = defaultdict(list)
    for slot, expert in zip(slots.tolist(), row[slots].tolist(), strict=True):
        out[expert].append(slot)
    return out


def _source(layer, expert, dst_rank, dst_slot, holders, rank_nodes, backup, sent_bytes):
    """The source of a slot that does not keep its expert: `holders` are the expert's (rank, old
    slot) on live ranks, in slot order."""
    on_rank = [slot for rank, slot in holders if rank == dst_rank]
    if on_rank:
        return Transfer(layer, expert, dst_rank, dst_slot, "local", dst_rank, on_rank[0])
    if holders:
        node = rank_nodes.get(dst_rank)
        rank, slot = min(holders, key=lambda h: (rank_nodes.get(h[0]) != node, sent_bytes[h[0]], h[0]))
        return Transfer(layer, expert, dst_rank, dst_slot, "peer", rank, slot)
    if backup.get((layer, expert)) is not None:
        return Transfer(layer, expert, dst_rank, dst_slot, "backup", src_node=backup[(layer, expert)])
    return Transfer(layer, expert, dst_rank, dst_slot, "disk")
