"""The restore placements of an epoch's likely losses, computed off the control thread.

Once an epoch of at least `MIN_RANKS` members forms, `RestoresAhead.prepare` hands its
placement, members, nodes, backups and the load estimate of that moment to a process of its own
(spawned once, at a low CPU priority, so it takes neither the control thread's GIL nor, on a
busy host, much of its core), which computes the restore placement of every single member's loss and
of every node's (placement/restore_ahead.py). After a fault, `lookup` returns the precomputed
placement when the loss and everything the restore reads are as prepared: the same epoch and
placement, the survivors all serving and nothing suspect, no rank taken in, the same nodes and
backups. Anything else (another loss, a rejoin, the computation not done yet) returns None and
the epoch change computes it on the control thread as before.

What it costs: the restore of a precomputed loss is for the load as the epoch formed, not as it
is at the fault (the balanced placement the background rebalance walks to afterwards is
computed for the load of then); and each epoch (a background rebalance's moves included) starts
the computation again, the previous one stopping at its next loss (not reused: the restore reads
the epoch's load and every holding rank's slots, ARCHITECTURE). That costs little where the
redundancy leaves every expert a copy after any likely loss: such a loss is counted, not
restored (~0.5 s for the 1,152 losses of 1,024 ranks x 10 slots).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized

import numpy as np

from elastic_ep.placement.location import ExpertLocation
from elastic_ep.placement.restore_ahead import Loss, apply_fills, likely_losses, restores_ahead

MIN_RANKS = 16  # below, a restore takes a few ms on the control thread: no process for it

_current: Synchronized | None = None  # in the worker: the epoch the control thread wants restores for


def _init_worker(current: Synchronized, niceness: int, parent_pid: int = 0) -> None:
    """In the worker: the epoch to compute for, its priority, and (a process) its end with the
    controller's: a pool's idle worker waits on its queue for ever when the controller is killed
    (kill -9 left it running, its parent gone), so it watches its parent and exits when it is gone."""
    global _current
    _current = current
    if niceness:
        os.nice(niceness)
    if parent_pid:
        threading.Thread(target=_exit_with, args=(parent_pid,), name="exit-with-parent", daemon=True).start()


def _exit_with(parent_pid: int, interval_s: float = 0.5) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    os._exit(0)


def _compute(epoch: int, *args) -> dict[Loss, np.ndarray | None]:
    return restores_ahead(*args, wanted=lambda: _current is None or _current.value == epoch)


def process_worker(current: Synchronized) -> cf.Executor:
    """One spawned process (spawn: the controller's process has threads) at nice 10: on a busy
    host it yields the core to the control thread, but is not starved for minutes as at 19."""
    return cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                                  initargs=(current, 10, os.getpid()))


def thread_worker(current: Synchronized) -> cf.Executor:
    """A thread instead of a process (tests)."""
    _init_worker(current, 0)
    return cf.ThreadPoolExecutor(1)


@dataclass(frozen=True)
class Prepared:
    """What one epoch's restores were computed from."""

    epoch: int
    location: ExpertLocation
    members: tuple[int, ...]
    rank_nodes: dict[int, str]
    backup: dict[tuple[int, int], str]
    load: np.ndarray
    result: cf.Future


class RestoresAhead:
    """`prepare` after each epoch forms, `lookup` at a fault, `close` when the controller stops.
    `worker(current)`: the executor to compute in (default `process_worker`), started at the
    first `prepare` of a large enough epoch; `current` holds the epoch the computation is for."""

    def __init__(self, worker: Callable[[Synchronized], cf.Executor] = process_worker, min_ranks: int = MIN_RANKS):
        self.worker = worker
        self.min_ranks = min_ranks
        self._current: Synchronized = multiprocessing.get_context("spawn").Value("q", -1)
        self._executor: cf.Executor | None = None
        self.prepared: Prepared | None = None
        self.last: str = ""  # how the last recovery's placement was found (the epoch event's `restore`)

    def prepare(self, epoch: int, location: ExpertLocation, members: list[int], rank_nodes: Mapping[int, str],
                backup: Mapping[tuple[int, int], str], load: np.ndarray) -> None:
        """Start computing the restores of `epoch`'s likely losses (the previous epoch's stop)."""
        self._current.value = epoch
        self.prepared = None
        if len(members) < self.min_ranks:
            return
        if self._executor is None:
            self._executor = self.worker(self._current)
        members = sorted(members)
        nodes = {r: rank_nodes[r] for r in members}
        backup, load = dict(backup), np.array(load, dtype=np.float64)
        future = self._executor.submit(_compute, epoch, location.phy2log, location.slots_per_rank,
                                       location.num_experts, load, members, nodes, backup,
                                       likely_losses(members, nodes))
        self.prepared = Prepared(epoch, location, tuple(members), nodes, backup, load, future)

    def submit(self, fn: Callable, *args) -> cf.Future:
        """Another pure computation for the worker (a background rebalance's target), queued after
        the restores it is computing; the worker is started if it is not yet."""
        if self._executor is None:
            self._executor = self.worker(self._current)
        return self._executor.submit(fn, *args)

    def lookup(self, epoch: int, location: ExpertLocation | None, held: ExpertLocation, holding: list[int],
               serving: list[int], rank_nodes: Mapping[int, str], backup: Mapping[tuple[int, int], str],
               suspect: bool) -> ExpertLocation | None:
        """The restore placement precomputed for this fault, or None (and `last` says why).

        epoch, location: the epoch and placement the fault ended; held: what the survivors hold
        (the restore's input); holding: the ranks of the new epoch; serving: the survivors that
        served; suspect: whether any slot is suspect."""
        p = self.prepared
        if p is None:
            self.last = "computed: no restores prepared for this epoch"
            return None
        loss = frozenset(p.members) - frozenset(holding)
        if (p.epoch != epoch or p.location is not location or suspect or sorted(holding) != sorted(serving)
                or not set(holding) <= set(p.members) or held.phy2log.shape != location.phy2log.shape):
            self.last = "computed: the epoch, its survivors or its slots are not as prepared"
            return None
        if not p.result.done():
            self.last = "computed: the restores of this epoch were still being computed"
            return None
        fills = p.result.result().get(loss) if p.result.exception() is None else None
        if fills is None or any(rank_nodes.get(r) != p.rank_nodes[r] for r in holding) or dict(backup) != p.backup:
            self.last = "computed: this loss, its nodes or its backups were not prepared"
            return None
        self.last = "looked up"
        return apply_fills(held, fills)

    def close(self) -> None:
        """Stop computing and end the worker process without waiting for it: it holds nothing worth
        finishing, and a pool's own shutdown was seen to leave it running for over 60 s (once in
        the suite, Python 3.11), so it is also terminated."""
        self._current.value = -1
        if self._executor is not None:
            processes = list((getattr(self._executor, "_processes", None) or {}).values())
            self._executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            self._executor = None
