"""Expert-parallel MoE on real gloo groups: routing to replicas, the counted and the padded
dispatch, against every expert computed in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elastic_ep.model.moe import local_moe_fn
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.runtime.ep_moe import ExpertParallelMoE, route_to_slots
from elastic_ep.runtime.experts import ExpertSlots
from elastic_ep.runtime.group import EpochGroup, ProgressBoard

from .ranks import run_ranks

E, S, H, INTER, K = 6, 4, 8, 4, 2
# two ranks, 4 slots each: experts 0 and 3 have a replica on both ranks
PHY2LOG = np.array([[0, 1, 2, 3, 4, 5, 0, 3]])
TOKENS = {0: 0, 1: 7}  # rank 0 brings no tokens and still runs every collective


def expert_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, H], topk_ids [T, K] (distinct per token), topk_weights [T, K] of one rank."""
    g = torch.Generator().manual_seed(10 + rank)
    tokens = TOKENS[rank]
    hidden = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]) if tokens else torch.empty(0, K)
    return hidden, ids.long(), torch.rand(tokens, K, generator=g)


def build_moe(rank: int, world: int, store, layers: int = 1) -> ExpertParallelMoE:
    """Rank `rank` of a 2-rank group holding PHY2LOG's experts in every one of `layers` MoE layers."""
    group = EpochGroup(0, list(range(world)), rank, "gloo", torch.device("cpu"))
    group.form(store, 30, lambda: False)
    location = ExpertLocation.from_phy2log(np.repeat(PHY2LOG, layers, axis=0), S, E)
    w13_all, w2_all = expert_weights()
    slots = ExpertSlots(list(range(layers)), S, INTER, H)
    for li in range(layers):
        for j, expert in enumerate(location.experts_of_rank(rank)[li]):
            slots.w13[li][j].copy_(w13_all[expert])
            slots.w2[li][j].copy_(w2_all[expert])
    slots.experts = location.experts_of_rank(rank)
    return ExpertParallelMoE(slots, location.log2phy, location.logcnt, group, ProgressBoard(), list(range(layers)),
                             world)


def moe_rank(rank: int, world: int, store, dispatch_rows: int):
    moe = build_moe(rank, world, store)
    group = moe.group
    w13_all, w2_all = expert_weights()
    hidden, ids, weights = rank_batch(rank)
    moe.start_step(dispatch_rows)
    out = moe.moe_fn()(0, hidden, ids, weights)
    reference = local_moe_fn({0: (w13_all, w2_all)})(0, hidden, ids, weights)
    group.destroy()
    return {"error": float((out - reference).abs().max()) if len(hidden) else 0.0, "shape": list(out.shape),
            "load": moe.counters.expert_load.tolist(), "slot_tokens": moe.counters.slot_tokens}


@pytest.mark.e2e
@pytest.mark.parametrize("dispatch_rows", [0, max(TOKENS.values()) * K], ids=["counted", "padded"])
def test_dispatch_and_combine_equal_every_expert_in_one_process(dispatch_rows):
    results = run_ranks(moe_rank, 2, dispatch_rows)
    for rank, res in enumerate(results):
        assert res["shape"] == [TOKENS[rank], H]
        assert res["error"] < 1e-5
    # every (token, choice) is computed exactly once, on one replica
    assert sum(r["slot_tokens"] for r in results) == sum(TOKENS.values()) * K
    assert sum(map(sum, results[1]["load"])) == TOKENS[1] * K and sum(map(sum, results[0]["load"])) == 0


def failing_rank(rank: int, world: int, store, where: str):
    """Two MoE layers; rank 0's own computation raises ("local": before layer 1, "experts": in
    layer 0's experts), it finishes the step's collectives; then a clean step on both."""
    moe = build_moe(rank, world, store, layers=2)
    w13_all, w2_all = expert_weights()
    hidden, ids, weights = rank_batch(rank)
    reference = local_moe_fn({0: (w13_all, w2_all), 1: (w13_all, w2_all)})

    def two_layers(fn):
        return fn(1, fn(0, hidden, ids, weights), ids, weights)

    moe.start_step()
    failed, in_experts, first = False, False, None
    try:
        if rank == 0 and where == "experts":
            moe.fail_in_experts = True
        out0 = moe.moe_fn()(0, hidden, ids, weights)
        if rank == 0 and where == "local":
            raise RuntimeError("local computation failed")
        first = moe.moe_fn()(1, out0, ids, weights)
    except RuntimeError:
        failed, in_experts = True, moe.in_experts
        moe.finish_collectives(H)
    moe.start_step()
    second = two_layers(moe.moe_fn())
    expected = two_layers(reference)
    moe.group.destroy()
    return {"failed": failed, "in_experts": in_experts,
            "first_exact": first is not None and len(hidden) > 0 and bool(torch.allclose(first, expected, atol=1e-5)),
            "second_error": float((second - expected).abs().max()) if len(hidden) else 0.0}


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["local", "experts"])
def test_a_rank_whose_computation_fails_finishes_the_step_and_the_group_stays_whole(where):
    failed, survivor = run_ranks(failing_rank, 2, where)
    assert failed["failed"] and not survivor["failed"] and failed["in_experts"] == (where == "experts")
    # a local failure still computes the others' tokens in the failed rank's experts; a failure in
    # the experts sends zeros back (the controller drops that step)
    assert survivor["first_exact"] == (where == "local")
    # the next step of the same group is exact on both ranks
    assert survivor["second_error"] < 1e-5 and failed["second_error"] < 1e-5


def test_route_prefers_a_replica_on_the_own_rank_else_spreads_over_replicas():
    location = ExpertLocation.from_phy2log(PHY2LOG, S, E)
    log2phy, logcnt = torch.from_numpy(np.array(location.log2phy[0])), torch.from_numpy(np.array(location.logcnt[0]))
    ids = torch.tensor([[0, 4], [0, 4], [3, 1]])
    on_rank1 = route_to_slots(ids, log2phy, logcnt, S, rank_id=1).tolist()
    assert on_rank1 == [6, 4, 6, 4, 7, 1]  # experts 0 and 3 from rank 1's own replicas (slots 6, 7)
    on_rank0 = route_to_slots(ids, log2phy, logcnt, S, rank_id=0).tolist()
    assert on_rank0 == [0, 4, 0, 4, 3, 1]
    # a rank with no replica of expert 0 alternates between its two replicas by token index
    no_local = ExpertLocation.from_phy2log(np.array([[1, 2, 0, 3, 4, 5, 0, 3, -1, -1, -1, -1]]), S, E)
    l2p, cnt = torch.from_numpy(np.array(no_local.log2phy[0])), torch.from_numpy(np.array(no_local.logcnt[0]))
    spread = route_to_slots(torch.tensor([[0], [0], [0]]), l2p, cnt, S, rank_id=2).tolist()
    assert sorted(set(spread)) == [2, 6] and spread[0] != spread[1]
