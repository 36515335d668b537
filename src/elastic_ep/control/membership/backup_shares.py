"""Which node keeps which experts in its host-memory backup (the file itself: node/backup_file.py).

The share of an expert lives on a node that holds none of its replicas wherever one exists (else
an expert has a replica on every node), so losing a whole node never loses both an expert's
last replica and its backup; among those nodes the least loaded takes it, so every node keeps
about the same bytes in host memory.
"""

from __future__ import annotations

from elastic_ep.placement.location import ExpertLocation


def backup_shares(
    location: ExpertLocation, rank_nodes: dict[int, str], nodes: list[str]
) -> dict[str, list[tuple[int, int]]]:
    """node -> [(layer, expert)] it backs up: each (layer, expert) once, on a node that holds no
    replica of it when there is one (else on any: a node's loss then leaves a replica elsewhere),
    the least loaded such node, so the nodes share the memory evenly.
    Each node's list is in the order to write it: fewest replicas first, since a rank's loss can
    only take every copy of an expert with few copies."""
    shares: dict[str, list[tuple[int, int]]] = {n: [] for n in nodes}
    for layer in range(location.num_layers):
        for expert in range(location.num_experts):
            slots = [int(p) for p in location.log2phy[layer, expert, : int(location.logcnt[layer, expert])] if p >= 0]
            homes = [rank_nodes.get(location.rank_of_slot(p), nodes[0]) for p in slots]
            candidates = [n for n in nodes if n not in homes] or nodes  # replicas on every node: any node
            shares[min(candidates, key=lambda n: (len(shares[n]), nodes.index(n)))].append((layer, expert))
    return {n: sorted(items, key=lambda item: (int(location.logcnt[item]), item)) for n, items in shares.items()}
