"""DeepSeek's expert-parallel load balancer (deepseek-ai/EPLB), written from its published description.

Two policies. Hierarchical (when the expert groups divide evenly over the nodes): pack whole
groups onto nodes, replicate experts within each node, pack the replicas onto the node's GPUs.
Global (otherwise): replicate experts over the whole cluster and pack the replicas onto GPUs.
Replication adds a copy to the expert with the largest load per copy; packing is greedy
largest-first into the lightest bin that still has room, every bin taking the same count.

Ties break towards the lowest index (stable sorts), which reproduces the README example.
"""

from __future__ import annotations

import numpy as np

from elastic_ep.errors import PlacementError
from elastic_ep.placement.location import build_log2phy


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n items into `num_packs` bins of n / num_packs items each, balancing bin weight.

    weight: [X, n]. Returns (pack_index [X, n], rank_in_pack [X, n]).
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (rows, n)).copy(), np.zeros((rows, n), dtype=np.int64)
    pack_index = np.empty((rows, n), dtype=np.int64)
    rank_in_pack = np.empty((rows, n), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")
    for row in range(rows):
        pack_weight = [0.0] * num_packs
        pack_items = [0] * num_packs
        for item in order[row].tolist():
            pack = min((p for p in range(num_packs) if pack_items[p] < per_pack), key=pack_weight.__getitem__)
            pack_index[row, item] = pack
            rank_in_pack[row, item] = pack_items[pack]
            pack_weight[pack] += float(weight[row, item])
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give `num_phy` physical copies to n logical experts, one more each time to the largest load per copy.

    weight: [X, n]. Returns (phy2log [X, num_phy], replica_rank [X, num_phy], logcnt [X, n]).
    """
    rows, n = weight.shape
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    replica_rank = np.zeros((rows, num_phy), dtype=np.int64)
    logcnt = np.ones((rows, n), dtype=np.int64)
    row = np.arange(rows)
    for i in range(n, num_phy):
        hottest = np.argmax(weight / logcnt, axis=1)
        phy2log[:, i] = hottest
        replica_rank[:, i] = logcnt[row, hottest]
        logcnt[row, hottest] += 1
    return phy2log, replica_rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _hierarchical(
    weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """phy2log [L, num_phy] of the hierarchical policy. weight: [L, E] float."""
    num_layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_log // num_nodes
    phy_per_gpu = num_phy // num_gpus

    # Step 1: whole groups to nodes; "mlog" numbers experts node by node.
    group_weight = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_weight, num_nodes)
    log2mlog = (((group_node * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size))
    log2mlog = log2mlog.reshape(num_layers, num_log)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicas within each node.
    mlog_weight = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, log_per_node)
    phy2mlog, _, mlogcnt = replicate_experts(mlog_weight, num_phy // num_nodes)

    # Step 3: replicas to the node's GPUs; "pphy" numbers slots GPU by GPU.
    phy_weight = np.take_along_axis(mlog_weight / mlogcnt, phy2mlog, axis=1)
    gpu, rank_in_gpu = balanced_packing(phy_weight, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * phy_per_gpu + rank_in_gpu)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(num_layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * log_per_node)[None, :, None]).reshape(num_layers, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


def rebalance_experts(
    weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB: place `num_replicas` physical experts on `num_gpus` GPUs.

    weight: [L, E] load per logical expert (array-like, numpy or CPU torch).
    Uses the hierarchical policy when num_groups % num_nodes == 0, else the global one.
    Returns (phy2log [L, num_replicas], log2phy [L, E, R] (-1 padded, slots ascending),
    logcnt [L, E]); slots g * num_replicas // num_gpus .. belong to GPU g.
    """
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 2:
        raise PlacementError(f"weight must be [layers, experts], got shape {list(w.shape)}")
    num_log = w.shape[1]
    if num_gpus < 1 or num_replicas % num_gpus:
        raise PlacementError(f"num_replicas={num_replicas} must be a positive multiple of num_gpus={num_gpus}")
    if num_replicas < num_log:
        raise PlacementError(
            f"{num_replicas} slots cannot hold {num_log} experts: {num_log - num_replicas} slots missing"
        )
    if num_groups >= 1 and num_nodes >= 1 and num_groups % num_nodes == 0:
        if num_log % num_groups:
            raise PlacementError(f"{num_log} experts do not split into {num_groups} equal groups")
        if num_gpus % num_nodes:
            raise PlacementError(
                f"hierarchical EPLB needs num_gpus ({num_gpus}) divisible by num_nodes ({num_nodes})"
            )
        phy2log = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    log2phy, logcnt = build_log2phy(phy2log, num_log)
    return phy2log, log2phy, logcnt
