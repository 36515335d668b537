"""The node's host-memory backup file: its format, how the agent writes it and how workers read it.

One safetensors file per node under /dev/shm, owned by the node agent so it outlives any worker
crash: the routed experts of the node's share (`layer<L>.expert<E>.w13|w2`, L = MoE layer index)
and the dense weights (`dense.<name>`) for ranks that restart. Same-node workers read it with
`safe_open` (mmap); other nodes ask the agent, which reads it the same way.
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

SHM_DIR = "/dev/shm"
DENSE_PREFIX = "dense."


def backup_key(layer: int, expert: int, part: str) -> str:
    """Tensor name of an expert in a backup file (layer = MoE layer index, part w13 or w2)."""
    return f"layer{layer}.expert{expert}.{part}"


def write_backup(
    reader: CheckpointReader, items: list[tuple[int, int]], node: str, directory: str = SHM_DIR,
    dense: bool = True,
) -> tuple[str, int]:
    """Read `items` (MoE layer index, expert) from the checkpoint into a safetensors file in
    `directory` (RAM-backed /dev/shm by default), plus the dense weights when `dense`, for ranks
    that restart; returns (path, bytes)."""
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


def read_dense(path: str) -> dict[str, torch.Tensor]:
    """The dense tensors of a backup file (name -> tensor). Raises KeyError when it has none."""
    with safe_open(path, framework="pt") as f:
        state = {k[len(DENSE_PREFIX):]: f.get_tensor(k) for k in f.keys() if k.startswith(DENSE_PREFIX)}
    if not state:
        raise KeyError(f"{path} holds no dense weights")
    return state
