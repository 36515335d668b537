"""The node's host-memory backup file: its format, how the agent writes it and how workers read it.

One safetensors file per node under /dev/shm, owned by the node agent so it outlives any worker
crash: the routed experts of the node's share (`layer<L>.expert<E>.w13|w2`, L = MoE layer index)
and the dense weights (`dense.<name>`) for ranks that restart. Same-node workers read it with
`safe_open` (mmap); other nodes ask the agent, which reads it the same way.

Nothing is left behind (at DeepSeek-V3 size the file is ~160 GB of RAM per node): its name
carries the owner process (`pid<PID>-<start time>`, the start time tells a reused pid), a
guard process removes it the moment its owner is gone, however it ended (`guard_backup`; SIGKILL
included), and an agent that starts removes the files of owners that are gone
(`reap_stale_backups`) in case the guard was killed too. Files without an owner tag (written by
older versions) are left alone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elastic_ep.model.checkpoint import CheckpointReader

SHM_DIR = "/dev/shm"
DENSE_PREFIX = "dense."
FILE_PREFIX = "elastic-ep-backup-"
OWNED_NAME = re.compile(rf"^{FILE_PREFIX}.+-pid(\d+)-(\d+)-[^-]+\.safetensors$")
# Waits until its stdin closes (its owner is gone: only the owner holds the pipe), then removes the file.
_GUARD = "import os, sys\nsys.stdin.buffer.read()\ntry:\n    os.unlink(sys.argv[1])\nexcept OSError:\n    pass\n"


def _start_cs(pid: int) -> int:
    """The process's start time in centiseconds since the epoch (pid plus this names one process)."""
    return int(psutil.Process(pid).create_time() * 100)


def owner_tag(pid: int) -> str:
    return f"pid{pid}-{_start_cs(pid)}"


def owner_alive(path: str) -> bool | None:
    """Whether the process named in a backup file's name still runs (None: the name has no owner tag)."""
    match = OWNED_NAME.match(os.path.basename(path))
    if match is None:
        return None
    pid, start_cs = int(match[1]), int(match[2])
    try:
        return abs(_start_cs(pid) - start_cs) <= 1
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def backup_dir(directory: str = SHM_DIR) -> str:
    """Where backup files go: `directory` (RAM-backed /dev/shm by default), else the temp dir."""
    return directory if os.path.isdir(directory) else tempfile.gettempdir()


def reap_stale_backups(directory: str = SHM_DIR) -> list[str]:
    """Remove the backup files in backup_dir(directory) whose owner process is gone; returns their paths."""
    removed = []
    for path in sorted(Path(backup_dir(directory)).glob(f"{FILE_PREFIX}*.safetensors")):
        if owner_alive(str(path)) is False:
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(str(path))
    return removed


def guard_backup(path: str) -> subprocess.Popen:
    """A small process that removes `path` once this process is gone, whether it exits, crashes or
    is SIGKILLed: it reads a pipe only this process holds open. Close its stdin to let it go (it
    then removes the file, if still there, and exits)."""
    return subprocess.Popen([sys.executable, "-I", "-c", _GUARD, path], stdin=subprocess.PIPE,
                            start_new_session=True)


def backup_key(layer: int, expert: int, part: str) -> str:
    """Tensor name of an expert in a backup file (layer = MoE layer index, part w13 or w2)."""
    return f"layer{layer}.expert{expert}.{part}"


def write_backup(
    reader: CheckpointReader, items: list[tuple[int, int]], node: str, directory: str = SHM_DIR,
    dense: bool = True,
) -> tuple[str, int]:
    """Read `items` (MoE layer index, expert) from the checkpoint into a safetensors file in
    `directory` (RAM-backed /dev/shm by default), plus the dense weights when `dense`, for ranks
    that restart; returns (path, bytes). The file is named for this process, its owner."""
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
    base = backup_dir(directory)
    fd, path = tempfile.mkstemp(prefix=f"{FILE_PREFIX}{node}-{owner_tag(os.getpid())}-", suffix=".safetensors",
                                dir=base)
    os.close(fd)
    save_file(tensors, path)
    return path, Path(path).stat().st_size


def read_backup(path: str, items: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [n, 2I, H], w2 [n, H, I] of `items` from a backup file. Raises KeyError for a missing item."""
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        for layer, expert in items:
            if backup_key(layer, expert, "w13") not in names:
                raise KeyError(f"layer {layer} expert {expert} is not in this node's backup")
        w13 = torch.stack([f.get_tensor(backup_key(layer, e, "w13")) for layer, e in items])
        w2 = torch.stack([f.get_tensor(backup_key(layer, e, "w2")) for layer, e in items])
    return w13, w2


def read_dense(path: str) -> dict[str, torch.Tensor]:
    """The dense tensors of a backup file (name -> tensor). Raises KeyError when it has none."""
    with safe_open(path, framework="pt") as f:
        state = {k[len(DENSE_PREFIX):]: f.get_tensor(k) for k in f.keys() if k.startswith(DENSE_PREFIX)}
    if not state:
        raise KeyError(f"{path} holds no dense weights")
    return state
