"""Pure helpers for a new epoch: what the ranks hold now, and the transfer plan split into
what each rank receives and sends.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from elastic_ep.placement.location import EMPTY, ExpertLocation
from elastic_ep.placement.transfer import TransferPlan
from elastic_ep.wire import SlotSource


def held_placement(
    current: ExpertLocation | None,
    num_layers: int,
    num_experts: int,
    slots_per_rank: int,
    num_ranks: int,
    holders: Iterable[int],
    suspect_slots: Iterable[tuple[int, int, int]] = (),
) -> ExpertLocation:
    """What the ranks hold now: `current` on `holders` (ranks that served in the last epoch and
    survive), empty everywhere else (new or restarted ranks) and in `suspect_slots`
    ((rank, layer, slot) that failed verification), so a plan refills them."""
    phy2log = np.full((num_layers, num_ranks * slots_per_rank), EMPTY)
    if current is not None:
        kept = current.restricted_to(holders).phy2log
        width = min(kept.shape[1], phy2log.shape[1])
        phy2log[:, :width] = kept[:, :width]
        for r, layer, j in suspect_slots:
            phy2log[layer, r * slots_per_rank + j] = EMPTY
    return ExpertLocation.from_phy2log(phy2log, slots_per_rank, num_experts)


def split_by_rank(
    plan: TransferPlan, slots_per_rank: int
) -> tuple[dict[int, list[SlotSource]], dict[int, list[tuple[int, int, int]]]]:
    """Per receiving rank, the sources of its changed slots in (layer, slot) order; per sending
    rank, (dst_rank, layer, src_slot) in the order each receiver lists its peer sources.
    Slot numbers become indices within a rank."""
    sources: dict[int, list[SlotSource]] = defaultdict(list)
    sends: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    s = slots_per_rank
    for t in sorted(plan.moved, key=lambda t: (t.dst_rank, t.layer, t.dst_slot)):
        src_slot = t.src_slot % s if t.src_slot >= 0 else -1
        sources[t.dst_rank].append(
            SlotSource(t.layer, t.dst_slot % s, t.expert, t.source, t.src_rank, src_slot, str(t.src_node or ""))
        )
        if t.source == "peer":
            sends[t.src_rank].append((t.dst_rank, t.layer, src_slot))
    return sources, sends


def trimmed(location: ExpertLocation | None, num_ranks: int) -> ExpertLocation | None:
    """`location` cut down to `num_ranks` ranks once the ranks above have been emptied
    (scale-down), so a later epoch does not carry ranks that no longer exist."""
    if location is None:
        return None
    if num_ranks >= location.num_ranks or (location.by_rank()[:, num_ranks:] >= 0).any():
        return location
    phy2log = location.phy2log[:, : num_ranks * location.slots_per_rank]
    return ExpertLocation.from_phy2log(phy2log, location.slots_per_rank, location.num_experts)
