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
    """Every filled slot of the new placement on a live rank, with its source and the byte totals."""

    transfers: tuple[Transfer, ...]
    bytes_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_moved(self) -> int:
        """Bytes that cross the wire or come from storage: peer + backup + disk."""
        return sum(self.bytes_by_source[k] for k in ("peer", "backup", "disk"))

    def moves(self) -> list[Transfer]:
        """The transfers that copy anything (all but keep)."""
        return [t for t in self.transfers if t.source != "keep"]


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
    holders = _live_holders(old, live)
    sent_bytes: dict[int, int] = defaultdict(int)
    totals = dict.fromkeys(SOURCE_KINDS, 0)
    transfers = []
    for layer in range(new.num_layers):
        layer_holders = holders[layer]
        for dst_slot in np.nonzero(new.phy2log[layer] >= 0)[0].tolist():
            expert = int(new.phy2log[layer, dst_slot])
            dst_rank = dst_slot // new.slots_per_rank
            t = _source(layer, expert, dst_rank, dst_slot, new.slots_per_rank, old.slots_per_rank,
                        layer_holders.get(expert, ()), rank_nodes, backup, sent_bytes)
            if t.source == "peer":
                sent_bytes[t.src_rank] += expert_nbytes
            totals[t.source] += expert_nbytes
            transfers.append(t)
    return TransferPlan(tuple(transfers), totals)


def _live_holders(old: ExpertLocation, live: set[int]) -> list[dict[int, list[tuple[int, int]]]]:
    """Per layer: expert -> [(rank, old slot)] on live ranks."""
    out: list[dict[int, list[tuple[int, int]]]] = [defaultdict(list) for _ in range(old.num_layers)]
    layers, slots = np.nonzero(old.phy2log >= 0)
    for layer, slot in zip(layers.tolist(), slots.tolist(), strict=True):
        rank = slot // old.slots_per_rank
        if rank in live:
            out[layer][int(old.phy2log[layer, slot])].append((rank, slot))
    return out


def _source(layer, expert, dst_rank, dst_slot, new_spr, old_spr, holders, rank_nodes, backup, sent_bytes):
    on_rank = [slot for rank, slot in holders if rank == dst_rank]
    j = dst_slot % new_spr
    if j < old_spr and dst_rank * old_spr + j in on_rank:
        return Transfer(layer, expert, dst_rank, dst_slot, "keep", dst_rank, dst_rank * old_spr + j)
    if on_rank:
        return Transfer(layer, expert, dst_rank, dst_slot, "local", dst_rank, on_rank[0])
    if holders:
        node = rank_nodes.get(dst_rank)
        rank, slot = min(holders, key=lambda h: (rank_nodes.get(h[0]) != node, sent_bytes[h[0]], h[0]))
        return Transfer(layer, expert, dst_rank, dst_slot, "peer", rank, slot)
    if backup.get((layer, expert)) is not None:
        return Transfer(layer, expert, dst_rank, dst_slot, "backup", src_node=backup[(layer, expert)])
    return Transfer(layer, expert, dst_rank, dst_slot, "disk")
