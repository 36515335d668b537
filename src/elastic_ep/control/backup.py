"""Which node keeps which experts in its host-memory backup (the file itself: node/backup_file.py).

The share of an expert lives on a node other than the node of its first replica wherever there
is more than one node, so losing a whole node never loses both an expert's replica and its backup.
"""

from __future__ import annotations

from elastic_ep.placement.location import ExpertLocation


def backup_shares(location: ExpertLocation, rank_nodes: dict[int, str], nodes: list[str]) -> dict[str, list[tuple[int, int]]]:
    """node -> [(layer, expert)] it backs up: each (layer, expert) once, on the next node after
    the node of its first replica (round robin over `nodes`), the same node when there is one.
    Each node's list is in the order to write it: fewest replicas first, since a rank's loss can
    only take every copy of an expert with few copies."""
    shares: dict[str, list[tuple[int, int]]] = {n: [] for n in nodes}
    for layer in range(location.num_layers):
        for expert in range(location.num_experts):
            first = int(location.log2phy[layer, expert, 0])
            home = rank_nodes.get(location.rank_of_slot(first), nodes[0]) if first >= 0 else nodes[0]
            i = nodes.index(home) if home in nodes else 0
            shares[nodes[(i + 1) % len(nodes)]].append((layer, expert))
    return {n: sorted(items, key=lambda item: (int(location.logcnt[item]), item)) for n, items in shares.items()}
