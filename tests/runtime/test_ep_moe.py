"""Expert-parallel MoE on real gloo groups: routing to replicas, the counted, padded and
two-stage (hierarchical) dispatch, one or two interleaved micro-batches, against every expert
computed in one process; what crosses hosts; a rank whose own computation fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elastic_ep.harness.ranks import run_ranks
from elastic_ep.model.model import MoECall
from elastic_ep.model.moe import local_moe_fn
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.runtime.ep_moe import ExpertParallelMoE, LocalFailure, route_to_slots
from elastic_ep.runtime.exchange import Links
from elastic_ep.runtime.experts import ExpertSlots
from elastic_ep.runtime.group import EpochGroup, ProgressBoard

E, S, H, INTER, K = 6, 4, 8, 4, 2
# two ranks, 4 slots each: experts 0 and 3 have a replica on both ranks
PHY2LOG = np.array([[0, 1, 2, 3, 4, 5, 0, 3]])
# four ranks (hosts a = ranks 0, 1 and b = ranks 2, 3): expert 0 on both hosts, the others on one
PHY2LOG_4 = np.array([[0, 1, 2, -1, 3, 0, -1, -1, 4, 5, 0, -1, 5, 4, -1, -1]])
TOKENS = {0: 0, 1: 7, 2: 5, 3: 1}  # rank 0 brings no tokens and still runs every collective


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


def build_moe(rank: int, world: int, store, epoch: int = 0, layers: int = 1, nodes: list[str] | None = None,
              backend: str = "flat") -> ExpertParallelMoE:
    """Rank `rank` of a `world`-rank group holding PHY2LOG's (2 ranks) or PHY2LOG_4's experts
    in every one of `layers` MoE layers, its members on `nodes`."""
    group = EpochGroup(epoch, list(range(world)), rank, "gloo", torch.device("cpu"))
    group.form(store, 30, lambda: False)
    links = Links.form(group, nodes or [], backend, lambda: False)
    phy2log = PHY2LOG if world == 2 else PHY2LOG_4
    location = ExpertLocation.from_phy2log(np.repeat(phy2log, layers, axis=0), S, E)
    w13_all, w2_all = expert_weights()
    slots = ExpertSlots(list(range(layers)), S, INTER, H)
    for li in range(layers):
        for j, expert in enumerate(location.experts_of_rank(rank)[li]):
            if expert >= 0:
                slots.w13[li][j].copy_(w13_all[expert])
                slots.w2[li][j].copy_(w2_all[expert])
    slots.experts = location.experts_of_rank(rank)
    return ExpertParallelMoE(slots, location.log2phy, location.logcnt, links, ProgressBoard(), list(range(layers)),
                             world, K)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to the largest expected value (float32 rounding differs
    with how rows are batched through the experts)."""
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1.0))


def layers_forward(hidden, ids, weights, layers: int = 1, fail_before: int = -1):
    """A forward of `layers` MoE layers over one batch, as `model.forward_stages` drives them;
    raises before MoE layer `fail_before` (a local error)."""
    x = hidden
    for layer in range(layers):
        if layer == fail_before:
            raise RuntimeError("local computation failed")
        x = yield MoECall(layer, x, ids, weights)
    return x


CASES = [  # (world, nodes, backend, padded, micro-batches)
    (2, None, "flat", False, 1), (2, None, "flat", True, 1), (2, None, "flat", False, 2), (2, None, "flat", True, 2),
    (4, list("aabb"), "flat", False, 1), (4, list("aabb"), "hierarchical", False, 1),
    (4, list("aabb"), "hierarchical", True, 1), (4, list("aabb"), "hierarchical", False, 2),
    (4, list("aabb"), "hierarchical", True, 2), (4, list("aaab"), "hierarchical", False, 2),
    (4, list("abab"), "hierarchical", False, 1),
]


def moe_cases(rank: int, world: int, store):
    """Every case of CASES for this world size, one epoch each; the error against one process."""
    out = []
    w13_all, w2_all = expert_weights()
    reference = local_moe_fn({0: (w13_all, w2_all)})
    for epoch, (size, nodes, backend, padded, parts) in enumerate(CASES):
        if size != world:
            continue
        moe = build_moe(rank, world, store, epoch, nodes=nodes, backend=backend)
        hidden, ids, weights = rank_batch(rank)
        busiest = max(TOKENS[r] for r in range(world))
        moe.start_step(busiest * K if padded else 0, parts)
        pieces = torch.tensor_split(torch.arange(len(hidden)), parts)  # as overlap.split_chunks cuts tokens
        results = moe.run([layers_forward(hidden[p], ids[p], weights[p]) for p in pieces])
        got = torch.cat(results)
        expected = reference(0, hidden, ids, weights)
        moe.group.destroy()
        out.append({"error": relative_error(got, expected) if len(hidden) else 0.0, "shape": list(got.shape),
                    "slot_tokens": moe.counters.slot_tokens, "remote_messages": moe.counters.remote_messages,
                    "remote_bytes": moe.counters.remote_bytes})
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_and_micro_batching_equals_every_expert_in_one_process(world):
    cases = [c for c in CASES if c[0] == world]
    results = run_ranks(moe_cases, world)
    for i, case in enumerate(cases):
        for rank, res in enumerate(results):
            assert res[i]["shape"] == [TOKENS[rank], H], case
            assert res[i]["error"] < 1e-5, (case, rank, res[i]["error"])
        # every (token, choice) is computed exactly once, on one replica
        assert sum(r[i]["slot_tokens"] for r in results) == sum(TOKENS[r] for r in range(world)) * K, case
    if world == 4:
        flat, hier = (sum(r[cases.index(c)]["remote_messages"] for r in results)
                      for c in [CASES[4], CASES[5]])
        # flat: each of 4 ranks sends to the 2 ranks of the other host, 3 collectives per layer;
        # two-stage: only the 2 leaders cross, to 1 other leader, in B counts, B rows and B'
        assert (flat, hier) == (4 * 2 * 3, 2 * 1 * 3)
        flat_bytes, hier_bytes = (sum(r[cases.index(c)]["remote_bytes"] for r in results)
                                  for c in [CASES[4], CASES[5]])
        assert hier_bytes < flat_bytes


def failing_rank(rank: int, world: int, store, where: str, parts: int):
    """Two MoE layers; rank 0's own computation raises ("local": before layer 1, "experts": in
    layer 0's experts), it still runs the step's collectives; then a clean step on both."""
    moe = build_moe(rank, world, store, layers=2)
    w13_all, w2_all = expert_weights()
    hidden, ids, weights = rank_batch(rank)
    reference = local_moe_fn({0: (w13_all, w2_all), 1: (w13_all, w2_all)})
    expected = reference(1, reference(0, hidden, ids, weights), ids, weights)
    pieces = torch.tensor_split(torch.arange(len(hidden)), parts)

    moe.start_step(0, parts)
    failed, in_experts, first = False, False, None
    if rank == 0 and where == "experts":
        moe.fail_in_experts = True
    fail_before = 1 if rank == 0 and where == "local" else -1
    try:
        first = torch.cat(moe.run([layers_forward(hidden[p], ids[p], weights[p], 2, fail_before) for p in pieces]))
    except LocalFailure as e:
        failed, in_experts = True, e.in_experts
    moe.start_step(0, parts)
    second = torch.cat(moe.run([layers_forward(hidden[p], ids[p], weights[p], 2) for p in pieces]))
    moe.group.destroy()
    return {"failed": failed, "in_experts": in_experts,
            "first_exact": first is not None and len(hidden) > 0 and relative_error(first, expected) < 1e-5,
            "second_error": relative_error(second, expected) if len(hidden) else 0.0}


@pytest.mark.e2e
@pytest.mark.parametrize("parts", [1, 2], ids=["one-micro-batch", "two-micro-batches"])
@pytest.mark.parametrize("where", ["local", "experts"])
def test_a_rank_whose_computation_fails_finishes_the_step_and_the_group_stays_whole(where, parts):
    failed, survivor = run_ranks(failing_rank, 2, where, parts)
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


def test_route_prefers_a_replica_on_the_own_host_when_the_own_rank_has_none():
    # ranks 0, 1 on host 0 and ranks 2, 3 on host 1; expert 0 on ranks 0, 1 and 2 (slots 0, 5, 10)
    location = ExpertLocation.from_phy2log(PHY2LOG_4, S, E)
    log2phy, logcnt = torch.from_numpy(np.array(location.log2phy[0])), torch.from_numpy(np.array(location.logcnt[0]))
    hosts = torch.tensor([0, 0, 1, 1])
    expert0 = torch.tensor([[0]] * 4)
    assert route_to_slots(expert0, log2phy, logcnt, S, rank_id=3, host_of_rank=hosts).tolist() == [10] * 4
    assert route_to_slots(expert0, log2phy, logcnt, S, rank_id=1, host_of_rank=hosts).tolist() == [5] * 4
    # expert 3 lives on host 0 only: every rank of host 1 reaches across
    assert route_to_slots(torch.tensor([[3]]), log2phy, logcnt, S, rank_id=3, host_of_rank=hosts).tolist() == [4]
    # without hosts, rank 3 spreads expert 0 over all three replicas
    assert sorted(set(route_to_slots(expert0, log2phy, logcnt, S, rank_id=3).tolist())) == [0, 5, 10]
