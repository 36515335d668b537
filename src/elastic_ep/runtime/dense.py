"""A joining rank's dense weights (attention, norms, embeddings, shared experts, routers): from
a live copy in host memory where there is one, else from the checkpoint.

Each node agent keeps the dense weights in its backup file in /dev/shm (read from disk once,
when the first epoch forms). A rank that restarts (`join_mode` recover, or a scale-up) maps
that file when its own node has one, asks another node's agent over ZeroMQ (`DenseFetch`)
otherwise, and falls back to the checkpoint if neither answers: read once, copy many.
"""

from __future__ import annotations

import time

import torch

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.node.backup_file import read_dense
from elastic_ep.wire import ClusterKey, DenseFetch

from .experts import ask_agent


def fetch_dense(addr: str, timeout_s: float, key: ClusterKey) -> dict[str, torch.Tensor]:
    """Ask the agent at `addr` for its dense weights. Raises TimeoutError / RuntimeError."""
    return ask_agent(addr, DenseFetch(), timeout_s, "dense weights", key).tensors


def load_dense(reader: CheckpointReader, path: str, addr: str, timeout_s: float,
               key: ClusterKey) -> tuple[dict, str, float]:
    """(state, source, seconds): source is "host_memory" (this node's agent file, `path`),
    "peer" (another node's agent at `addr`, asked with the cluster `key`) or "disk" (the
    checkpoint, also when both fail)."""
    t0 = time.perf_counter()
    for source, load in (("host_memory", lambda: read_dense(path)),
                         ("peer", lambda: fetch_dense(addr, timeout_s, key))):
        if not (path if source == "host_memory" else addr):
            continue
        try:
            return load(), source, time.perf_counter() - t0
        except (OSError, KeyError, TimeoutError, RuntimeError):
            continue
    return reader.dense_state(), "disk", time.perf_counter() - t0
