"""OffThread: from its rank threshold a computation goes to the worker and is taken once done; below
it, or without a worker, it runs at once; a result for another key is dropped; a worker that died
leaves the computation to this thread, with the arguments it was asked with."""

from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures.process import BrokenProcessPool

from elastic_ep.control.epochs.off_thread import OFF_THREAD_RANKS, OffThread


class Worker:
    def __init__(self):
        self.jobs: list[tuple[object, tuple, cf.Future]] = []

    def submit(self, fn, *args) -> cf.Future:
        future: cf.Future = cf.Future()
        self.jobs.append((fn, args, future))
        return future


def add(a: int, b: int) -> int:
    return a + b


def test_a_large_computation_is_taken_once_done_and_only_for_its_key():
    worker = Worker()
    off = OffThread(worker.submit)
    off.start("epoch 3", OFF_THREAD_RANKS, add, 1, 2)
    assert off.asked("epoch 3") and off.busy and not off.ready and off.take("epoch 3") is None
    worker.jobs[0][2].set_result(3)
    assert off.ready and not off.busy
    done = off.take("epoch 3")
    assert done is not None and done.value == 3 and done.args == (1, 2)
    assert not off.asked("epoch 3") and off.take("epoch 3") is None  # taken once

    off.start("epoch 4", OFF_THREAD_RANKS, add, 2, 2)
    worker.jobs[1][2].set_result(4)
    assert off.take("epoch 5") is None and not off.asked("epoch 4")  # for another epoch: dropped


def test_a_small_one_or_one_without_a_worker_runs_at_once():
    worker = Worker()
    for off, ranks in ((OffThread(worker.submit), OFF_THREAD_RANKS - 1), (OffThread(None), 1024)):
        off.start("k", ranks, add, 5, 6)
        assert off.ready and not off.busy and off.take("k").value == 11
    assert worker.jobs == []


def test_a_dead_worker_leaves_the_computation_to_this_thread():
    worker = Worker()
    off = OffThread(worker.submit)
    off.start("k", OFF_THREAD_RANKS, add, 7, 8)
    worker.jobs[0][2].set_exception(BrokenProcessPool("the worker process died"))
    done = off.take("k")
    assert done is not None and done.value == 15 and done.args == (7, 8)
