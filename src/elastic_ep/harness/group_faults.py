"""An epoch's process group under real faults of a peer, for any backend: the tests run them
with gloo on the CPU, `make gpu-check` with NCCL where a machine has two GPUs. Each is a
`run_ranks` target: `target(rank, world, store, backend)`.

- `peer_dies`: rank 1 exits after the group formed; rank 0's all-to-all must raise, not hang.
- `aborted_while_waiting`: rank 1 stops (SIGSTOP: no reset ever reaches its peers); rank 0's
  all-to-all waits on it until another thread of rank 0 aborts the epoch, as the heartbeat thread
  does on the controller's `AbortEpoch`; then rank 0 forms the next epoch's group alone.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from elastic_ep.runtime.group import CollectiveError, EpochGroup


def formed_pair(epoch: int, rank: int, store, backend: str) -> tuple[torch.device, EpochGroup]:
    """This rank's group of ranks 0 and 1, formed, and where its buffers live: NCCL's own GPU per
    rank, gloo the CPU."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    group = EpochGroup(epoch, [0, 1], rank, backend, device)
    group.form(store, 30, lambda: False)
    return device, group


def peer_dies(rank: int, world: int, store, backend: str = "gloo") -> dict | None:
    device, group = formed_pair(7, rank, store, backend)
    if rank == 1:
        store.set("rank1/exiting", "1")
        os._exit(0)
    store.wait(["rank1/exiting"])
    time.sleep(0.2)
    group.timeout_s = 10.0  # NCCL may not notice a dead peer: then the deadline frees the survivor
    t0 = time.monotonic()
    try:
        group.all_to_all(torch.empty(2, device=device), torch.ones(2, device=device))
    except CollectiveError as e:
        return {"raised": type(e).__name__, "message": str(e), "after_s": round(time.monotonic() - t0, 4)}
    return {"raised": None}


def aborted_while_waiting(rank: int, world: int, store, backend: str = "gloo") -> dict | None:
    device, group = formed_pair(8, rank, store, backend)
    if rank == 1:
        store.set("rank1/stopping", "1")
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    store.wait(["rank1/stopping"])
    aborted_at: list[float] = []

    def abort() -> None:
        aborted_at.append(time.monotonic())
        group.abort()

    threading.Timer(1.0, abort).start()
    try:
        group.all_to_all(torch.empty(2, device=device), torch.ones(2, device=device))
        raised = None
    except CollectiveError as e:
        raised = str(e)
    freed_after_s = time.monotonic() - aborted_at[0] if aborted_at else None
    group.destroy()
    alone = EpochGroup(9, [0], 0, backend, device)
    alone.form(store, 30, lambda: False)
    out = torch.empty(1, device=device)
    alone.all_to_all(out, torch.full((1,), 7.0, device=device))
    return {"raised": raised, "freed_after_s": freed_after_s, "next_epoch": out.cpu().tolist()}
