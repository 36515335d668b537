"""An epoch's process group on real processes: it forms, a newer epoch abandons a forming one,
a member that never arrives is named, a peer that dies makes the collective raise instead of
hanging, an abort frees a collective waiting on a stopped peer (both on NCCL too where two GPUs
are), and an expert exchange with a peer that comes late (many abort polls later) completes."""

from __future__ import annotations

import time

import pytest
import torch

from elastic_ep.harness.group_faults import aborted_while_waiting, peer_dies
from elastic_ep.harness.ranks import run_ranks
from elastic_ep.runtime.group import EpochGroup, EpochSuperseded


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


BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs (none here)"))]


@pytest.mark.e2e
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dead_peer_makes_the_collective_raise(backend):
    (survivor,) = run_ranks(peer_dies, 2, backend, answering=[0])
    assert survivor["raised"] == "CollectiveError"


@pytest.mark.e2e
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_aborted_epoch_frees_a_collective_waiting_on_a_stopped_peer(backend):
    (survivor,) = run_ranks(aborted_while_waiting, 2, backend, answering=[0])
    assert survivor["raised"] and "aborted the epoch" in survivor["raised"]
    assert survivor["next_epoch"] == [7.0]  # the broken group is left behind, the next one forms


@pytest.mark.e2e
def test_an_exchange_waits_out_a_late_peer():
    # gloo closes every pair when a point-to-point wait times out; the exchange's polls must not
    results = run_ranks(late_exchange, 3)
    for rank, got in enumerate(results):
        assert got == {p: [float(p)] * (5 + rank) for p in range(3) if p != rank}
