"""How many redundant expert slots a group needs to keep serving after it loses a rank or a node.

Slots per rank are fixed at start, `(num_experts + redundant) / ep_size`, so the redundant count
must make that sum divide evenly. After a loss the group serves on when the surviving ranks'
slots can still hold every expert once: `fault_aware_placement` re-places the experts over them
(copies from surviving replicas, else the host-memory backup, else disk). Without that room the
group has to wait for the lost ranks to come back.

"Survives" counts the worst case, by capacity: any `rank_losses` ranks, or the `node_losses`
largest nodes. It does not promise that no expert loses its last replica: the fault-aware
placement gives copies by load, so a cold expert may have one copy, which a loss then reloads
from the backup or disk (`sim redundancy` estimates how often).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from elastic_ep.errors import PlacementError


@dataclass(frozen=True)
class Survival:
    """What a slot geometry outlives: after any `rank_losses` dead ranks, or after its
    `node_losses` largest nodes die, the surviving slots still hold every expert once.
    `node_losses` is 0 for a group on one node (losing it loses every rank)."""

    rank_losses: int
    node_losses: int


@dataclass(frozen=True)
class RedundancyChoice:
    """A redundant-slot count and what it buys.

    redundant_experts: extra slots per layer over the whole group (`--redundant-experts`).
    slots_per_rank: (num_experts + redundant_experts) / ep_size.
    target: "rank" (survive one rank loss) or "node" (survive losing the largest node).
    survives: the losses this geometry outlives (at least the target's, where any count can).
    extra_bytes: GPU memory the redundant slots take over the whole group, all layers.
    expert_bytes_per_rank: GPU memory one rank's expert slots take, all layers.
    """

    redundant_experts: int
    slots_per_rank: int
    target: str
    survives: Survival
    extra_bytes: int
    expert_bytes_per_rank: int


def choose_redundant_experts(
    num_experts: int,
    ep_size: int,
    num_layers: int,
    expert_bytes: int,
    rank_nodes: Mapping[int, Hashable] | None = None,
    ranks_per_node: int | None = None,
) -> RedundancyChoice:
    """The fewest redundant slots with which the group still holds every expert after losing any
    one rank or, when its ranks run on several nodes, its largest node.

    num_experts: routed experts per MoE layer. ep_size: ranks in the group.
    num_layers: MoE layers. expert_bytes: bytes of one expert's weights in one layer (one slot).
    rank_nodes: rank -> node for ranks 0..ep_size-1; or ranks_per_node: ranks fill nodes of this
        many in order (the last may be smaller); neither: all ranks on one node.
    A group of one rank cannot survive its loss: it gets 0 redundant slots and `survives` says 0.
    Raises PlacementError on impossible arguments.
    """
    _check_sizes(num_experts, ep_size)
    if num_layers < 1 or expert_bytes < 0:
        raise PlacementError(f"num_layers ({num_layers}) must be >= 1 and expert_bytes ({expert_bytes}) >= 0")
    nodes = _node_sizes(ep_size, rank_nodes, ranks_per_node)
    target, lost = ("node", nodes[0]) if len(nodes) > 1 else ("rank", 1)
    slots = -(-num_experts // max(ep_size - lost, 1))
    redundant = slots * ep_size - num_experts
    return RedundancyChoice(
        redundant_experts=redundant,
        slots_per_rank=slots,
        target=target,
        survives=_survival(num_experts, ep_size, slots, nodes),
        extra_bytes=redundant * num_layers * expert_bytes,
        expert_bytes_per_rank=slots * num_layers * expert_bytes,
    )


def losses_survived(
    num_experts: int,
    ep_size: int,
    redundant_experts: int,
    rank_nodes: Mapping[int, Hashable] | None = None,
    ranks_per_node: int | None = None,
) -> Survival:
    """The rank and node losses a group of `ep_size` ranks with `redundant_experts` extra slots
    outlives (see Survival); nodes as in `choose_redundant_experts`.

    Raises PlacementError when redundant_experts is negative or num_experts + redundant_experts
    does not divide by ep_size (naming the nearest counts that do).
    """
    _check_sizes(num_experts, ep_size)
    if redundant_experts < 0:
        raise PlacementError(f"redundant experts must be >= 0, got {redundant_experts}")
    total = num_experts + redundant_experts
    if total % ep_size:
        below = total // ep_size * ep_size - num_experts
        nearest = ([str(below)] if below >= 0 else []) + [str(below + ep_size)]
        raise PlacementError(
            f"{num_experts} experts + {redundant_experts} redundant = {total} slots do not split evenly over "
            f"{ep_size} ranks; use {' or '.join(nearest)} redundant experts"
        )
    return _survival(num_experts, ep_size, total // ep_size, _node_sizes(ep_size, rank_nodes, ranks_per_node))


def _check_sizes(num_experts: int, ep_size: int) -> None:
    if num_experts < 1 or ep_size < 1:
        raise PlacementError(f"num_experts ({num_experts}) and ep_size ({ep_size}) must be >= 1")


def _survival(num_experts: int, ep_size: int, slots_per_rank: int, node_sizes: list[int]) -> Survival:
    """node_sizes: ranks per node, largest first."""
    needed_ranks = -(-num_experts // slots_per_rank)
    left, node_losses = ep_size, 0
    for size in node_sizes:
        left -= size
        if left < needed_ranks:
            break
        node_losses += 1
    return Survival(rank_losses=ep_size - needed_ranks, node_losses=node_losses)


def _node_sizes(
    ep_size: int, rank_nodes: Mapping[int, Hashable] | None, ranks_per_node: int | None
) -> list[int]:
    """Ranks per node, largest first."""
    if rank_nodes is not None and ranks_per_node is not None:
        raise PlacementError("give rank_nodes or ranks_per_node, not both")
    if ranks_per_node is not None:
        if ranks_per_node < 1:
            raise PlacementError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        full, rest = divmod(ep_size, ranks_per_node)
        return [ranks_per_node] * full + ([rest] if rest else [])
    if rank_nodes is None:
        return [ep_size]
    ranks = set(rank_nodes)
    if ranks != set(range(ep_size)):
        missing = sorted(set(range(ep_size)) - ranks)
        extra = sorted(ranks - set(range(ep_size)), key=str)
        raise PlacementError(
            f"rank_nodes must name the node of exactly ranks 0..{ep_size - 1}; missing {missing}, extra {extra}"
        )
    counts: dict[Hashable, int] = {}
    for node in rank_nodes.values():
        counts[node] = counts.get(node, 0) + 1
    return sorted(counts.values(), reverse=True)
