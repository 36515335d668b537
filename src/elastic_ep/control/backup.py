"""Host-memory expert backup: which node keeps which experts, and the node's backup file.

A node's share lives in one safetensors file under /dev/shm owned by the node agent, so it
outlives any worker crash; same-node workers read it with `safe_open` (mmap), other nodes ask
the agent (`BackupFetch`). The share of an expert lives on a node other than the node of its
first replica wherever there is more than one node.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.runtime.dense import DENSE_PREFIX
from elastic_ep.runtime.experts import backup_key

SHM_DIR = "/dev/shm"


def backup_shares(location: ExpertLocation, rank_nodes: dict[int, str], nodes: list[str]) -> dict[str, list[tuple[int, int]]]:
    """node -> [(layer, expert)] it backs up: each (layer, expert) once, on the next node after
    the node of its first replica (round robin over `nodes`), the same node when there is one."""
    shares: dict[str, list[tuple[int, int]]] = {n: [] for n in nodes}
    for layer in range(location.num_layers):
        for expert in range(location.num_experts):
            first = int(location.log2phy[layer, expert, 0])
            home = rank_nodes.get(location.rank_of_slot(first), nodes[0]) if first >= 0 else nodes[0]
            i = nodes.index(home) if home in nodes else 0
            shares[nodes[(i + 1) % len(nodes)]].append((layer, expert))
    return shares


def write_backup(
    reader: CheckpointReader, items: list[tuple[int, int]], node: str, directory: str = SHM_DIR,
    dense: bool = True,
) -> tuple[str, int]:
    """Read `items` (MoE layer index, expert) from the checkpoint into a safetensors file in
    `directory` (RAM-backed /dev/shm by default), plus the dense weights when `dense`, for ranks
    that restart (runtime.dense); returns (path, bytes)."""
    moe_layers = reader.config.moe_layers
    tensors: dict[str, torch.Tensor] = {}
    if dense:
        tensors.update({DENSE_PREFIX + name: t.contiguous() for name, t in reader.dense_state().items()})
    by_layer: dict[int, list[int]] = {}
    for layer, expert in items:
        by_layer.setdefault(layer, []).append(expert)
    for layer, experts in by_layer.items():
        w13, w2 = reader.read_experts(moe_layers[layer], experts)
        for i, expert in enumerate(experts):
            tensors[backup_key(layer, expert, "w13")] = w13[i].contiguous()
            tensors[backup_key(layer, expert, "w2")] = w2[i].contiguous()
    base = directory if os.path.isdir(directory) else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix=f"elastic-ep-backup-{node}-", suffix=".safetensors", dir=base)
    os.close(fd)
    save_file(tensors, path)
    return path, Path(path).stat().st_size


def read_backup(path: str, items: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """w13 [n, 2I, H], w2 [n, H, I] of `items` from a backup file. Raises KeyError for a missing item."""
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        for layer, expert in items:
            if backup_key(layer, expert, "w13") not in names:
                raise KeyError(f"layer {layer} expert {expert} is not in this node's backup")
        w13 = torch.stack([f.get_tensor(backup_key(layer, e, "w13")) for layer, e in items])
        w2 = torch.stack([f.get_tensor(backup_key(layer, e, "w2")) for layer, e in items])
    return w13.numpy(), w2.numpy()
