"""Which node keeps which experts in its host-memory backup (the file itself: node/backup_file.py).

The share of an expert lives on a node that holds none of its replicas wherever one exists (else
an expert has a replica on every node), so losing a whole node never loses both an expert's
last replica and its backup; among those nodes the least loaded takes it, so every node keeps
about the same bytes in host memory.
"""

from __future__ import annotations

import numpy as np

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
    index = {n: i for i, n in enumerate(nodes)}
    # node index of every slot (-1: a node outside `nodes`, which no candidate is); [S]
    default = nodes[0] if nodes else None
    slot_node = np.repeat([index.get(rank_nodes.get(r, default), -1) for r in range(location.num_ranks)],
                          location.slots_per_rank)
    for layer in range(location.num_layers):
        row = location.phy2log[layer]
        held = (row >= 0) & (slot_node >= 0)
        homes = np.zeros((location.num_experts, len(nodes)), dtype=bool)  # [E, N]: a replica of e on node n
        homes[row[held], slot_node[held]] = True
        for expert in range(location.num_experts):
            candidates = [n for n, home in zip(nodes, homes[expert].tolist(), strict=True) if not home] or nodes
            shares[min(candidates, key=lambda n: (len(shares[n]), nodes.index(n)))].append((layer, expert))
    return {n: sorted(items, key=lambda item: (int(location.logcnt[item]), item)) for n, items in shares.items()}
