"""The NCCL branch of an epoch group's waits, driven by scripted work and communicator objects
(no GPU here, so NCCL itself never runs in this suite): a finished collective is joined, a
peer's error is read from the work and raised, an abort or the deadline aborts the communicator
under a collective that never finishes, an abort that never returns marks the process wedged,
and leaving the group aborts its communicator on a thread of its own."""

from __future__ import annotations

import threading

import pytest
import torch

from elastic_ep.runtime import group as group_module
from elastic_ep.runtime.group import CollectiveError, EpochGroup


class ScriptedWork:
    """A collective that finishes after `polls` completion queries (never when None), with `error`."""

    def __init__(self, polls: int | None, error: Exception | None = None):
        self.polls, self.error, self.queries, self.joined = polls, error, 0, False

    def is_completed(self) -> bool:
        self.queries += 1
        return self.error is not None or (self.polls is not None and self.queries > self.polls)

    def exception(self):
        return self.error

    def wait(self) -> bool:
        self.joined = True
        return True


class ScriptedComm:
    """A communicator whose abort returns at once, or only when `release` is set."""

    def __init__(self, hangs: bool = False):
        self.aborted = threading.Event()
        self.release = threading.Event()
        if not hangs:
            self.release.set()

    def abort(self) -> None:
        self.aborted.set()
        self.release.wait()


def nccl_group(comm: ScriptedComm, timeout_s: float = 60.0) -> EpochGroup:
    group = EpochGroup(4, [0, 1], 0, "nccl", torch.device("cpu"))
    group.pg, group.alive, group.timeout_s = comm, True, timeout_s
    return group


@pytest.fixture(autouse=True)
def clear_wedged():
    yield
    group_module.WEDGED.clear()


def test_a_finished_collective_is_joined():
    comm, work = ScriptedComm(), ScriptedWork(polls=3)
    group = nccl_group(comm)
    group._wait(work, "all_to_all")
    assert work.joined and work.queries == 4
    assert not comm.aborted.is_set() and not group.broken


def test_a_peers_error_is_read_from_the_work_not_waited_on():
    comm, work = ScriptedComm(), ScriptedWork(polls=None, error=RuntimeError("NCCL remote error: peer 1 exited"))
    group = nccl_group(comm)
    with pytest.raises(CollectiveError, match="peer 1 exited"):
        group._wait(work, "all_to_all")
    assert group.broken and not work.joined  # wait() on an errored work would abort and raise on its own


@pytest.mark.parametrize("cause", ["abort", "deadline"])
def test_a_collective_that_never_finishes_aborts_the_communicator(cause):
    comm, work = ScriptedComm(), ScriptedWork(polls=None)
    group = nccl_group(comm, timeout_s=0.2 if cause == "deadline" else 60.0)
    if cause == "abort":  # the worker's heartbeat thread, on the controller's AbortEpoch
        threading.Timer(0.2, group.abort).start()
    with pytest.raises(CollectiveError, match="aborted"):
        group._wait(work, "all_to_all")
    assert comm.aborted.is_set() and group.broken and not group_module.WEDGED.is_set()


def test_an_abort_that_never_returns_marks_the_process_wedged(monkeypatch):
    monkeypatch.setattr(group_module, "NCCL_ABORT_WAIT_S", 0.2)
    comm = ScriptedComm(hangs=True)
    group = nccl_group(comm)
    group.abort()
    with pytest.raises(CollectiveError, match="aborted"):
        group._wait(ScriptedWork(polls=None), "all_to_all")
    assert group_module.WEDGED.is_set()
    comm.release.set()


def test_leaving_aborts_the_communicator_without_waiting_for_it():
    comm = ScriptedComm(hangs=True)
    group = nccl_group(comm)
    group.destroy()  # returns although the abort has not
    assert comm.aborted.wait(5) and group.pg is None and not group.alive
    comm.release.set()
