"""An epoch's process group on real processes: it forms, a newer epoch abandons a forming one,
a member that never arrives is named, a peer that dies makes the collective raise instead of
hanging, and an expert exchange with a peer that comes late (many abort polls later) completes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from elastic_ep.runtime.group import CollectiveError, EpochGroup, EpochSuperseded

from .ranks import run_ranks


def form_and_exchange(rank: int, world: int, store):
    group = EpochGroup(3, list(range(world)), rank, "gloo", torch.device("cpu"))
    group.form(store, 30, lambda: False)
    out = torch.empty(world, dtype=torch.int64)
    group.all_to_all(out, torch.full((world,), 10 * rank, dtype=torch.int64))
    group.destroy()
    return out.tolist(), group.alive


def never_arrives(rank: int, world: int, store):
    """Rank 0 waits for a member (rank 2) that never comes; rank 1 is superseded meanwhile."""
    if rank == 0:
        group = EpochGroup(5, [0, 1, 2], 0, "gloo", torch.device("cpu"))
        try:
            group.form(store, 1.0, lambda: False)
        except TimeoutError as e:
            return str(e)
        return "formed"
    group = EpochGroup(6, [1, 2], 1, "gloo", torch.device("cpu"))
    deadline = time.monotonic() + 0.3
    try:
        group.form(store, 30, lambda: time.monotonic() > deadline)
    except EpochSuperseded as e:
        return str(e)
    return "formed"


def late_exchange(rank: int, world: int, store):
    """Every member sends each other one buffer of its own length; rank 1 comes 0.4 s late."""
    group = EpochGroup(8, list(range(world)), rank, "gloo", torch.device("cpu"))
    group.form(store, 30, lambda: False)
    cpu = torch.device("cpu")
    group.exchange({}, {}, torch.float32, cpu)  # a member that moves nothing still takes part
    if rank == 1:
        time.sleep(0.4)
    others = [p for p in range(world) if p != rank]
    recvs = {p: torch.empty(5 + rank) for p in others}
    group.exchange({p: torch.full((5 + p,), float(rank)) for p in others}, recvs, torch.float32, cpu)
    group.destroy()
    return {p: r.tolist() for p, r in recvs.items()}


def peer_dies(rank: int, world: int, store):
    group = EpochGroup(7, [0, 1], rank, "gloo", torch.device("cpu"))
    group.form(store, 30, lambda: False)
    if rank == 1:
        store.set("rank1/exiting", "1")
        os._exit(0)
    store.wait(["rank1/exiting"])
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        out = torch.empty(2)
        group.all_to_all(out, torch.ones(2))
    except RuntimeError as e:
        return {"raised": type(e).__name__, "after_s": time.monotonic() - t0}
    return {"raised": None}


@pytest.mark.e2e
def test_members_form_the_group_exchange_and_leave_it():
    results = run_ranks(form_and_exchange, 3)
    assert [r[0] for r in results] == [[0, 10, 20]] * 3
    assert not any(alive for _, alive in results)


@pytest.mark.e2e
def test_a_missing_member_is_named_and_a_superseded_epoch_is_abandoned():
    timeout_error, superseded = run_ranks(never_arrives, 2)
    assert "ranks [1, 2] did not arrive" in timeout_error
    assert "epoch 6 was superseded" in superseded


@pytest.mark.e2e
def test_a_dead_peer_makes_the_collective_raise():
    (survivor,) = run_ranks(peer_dies, 2, answering=[0])
    assert survivor["raised"] == "CollectiveError"


def aborted_while_waiting(rank: int, world: int, store):
    """Rank 1 stops (SIGSTOP: no reset ever reaches its peers); rank 0 waits in an all_to_all with
    it until another thread of rank 0 aborts the epoch, as the heartbeat thread does on the
    controller's AbortEpoch; then rank 0 forms the next epoch's group alone."""
    group = EpochGroup(8, [0, 1], rank, "gloo", torch.device("cpu"))
    group.form(store, 30, lambda: False)
    if rank == 1:
        store.set("rank1/stopping", "1")
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    store.wait(["rank1/stopping"])
    threading.Timer(1.0, group.abort).start()
    t0 = time.monotonic()
    try:
        group.all_to_all(torch.empty(2), torch.ones(2))
        raised = None
    except CollectiveError as e:
        raised = str(e)
    waited_s = time.monotonic() - t0
    group.destroy()
    alone = EpochGroup(9, [0], 0, "gloo", torch.device("cpu"))
    alone.form(store, 30, lambda: False)
    out = torch.empty(1)
    alone.all_to_all(out, torch.full((1,), 7.0))
    return {"raised": raised, "waited_s": waited_s, "next_epoch": out.tolist()}


@pytest.mark.e2e
def test_an_aborted_epoch_frees_a_collective_waiting_on_a_stopped_peer():
    (survivor,) = run_ranks(aborted_while_waiting, 2, answering=[0])
    assert survivor["raised"] and "aborted the epoch" in survivor["raised"]
    assert survivor["next_epoch"] == [7.0]  # the broken group is left behind, the next one forms


@pytest.mark.e2e
def test_an_exchange_waits_out_a_late_peer():
    # gloo closes every pair when a point-to-point wait times out; the exchange's polls must not
    results = run_ranks(late_exchange, 3)
    for rank, got in enumerate(results):
        assert got == {p: [float(p)] * (5 + rank) for p in range(3) if p != rank}
