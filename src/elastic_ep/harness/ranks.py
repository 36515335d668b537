"""Run a function on N real ranks (spawned processes) that share one TCPStore, for tests (and the
GPU checks) of the data plane without a controller. Every process is joined or killed before returning."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_ep.harness.server_process import free_port


def _entry(target, rank: int, world: int, port: int, args: tuple, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        out.put((rank, "ok", target(rank, world, store, *args)))
    except BaseException as e:  # reported to the test, which fails with the child's traceback
        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(target, world: int, *args, answering: list[int] | None = None, timeout_s: float = 120.0) -> list:
    """target(rank, world, store, *args) on `world` processes; the return values of the
    `answering` ranks (default all; a rank that exits by itself gives none), in rank order.
    `target` must be a module-level function (it is pickled by name)."""
    answering = list(range(world)) if answering is None else answering
    ctx = mp.get_context("spawn")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        while len(results) < len(answering):
            try:
                rank, status, value = out.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(answering) - set(results))} did not finish "
                                   f"within {timeout_s}s") from None
            if status == "error":
                raise AssertionError(f"rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return [results[r] for r in answering]
