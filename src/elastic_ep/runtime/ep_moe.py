"""Expert parallelism for one MoE layer: route each (token, choice) to one replica of its
expert, dispatch with all_to_all_single, run the experts of this rank's slots, combine back.

Replica choice is deterministic: a replica on this rank if there is one (no network), else
replica `token_index % replica_count`, which spreads a hot expert's tokens over its replicas.
Every rank runs the three collectives of every layer even with zero tokens, which is what
keeps the group in step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from elastic_ep.model.moe import MoEFn, combine_weighted, grouped_expert_forward

from .experts import ExpertSlots
from .group import EpochGroup, ProgressBoard


@dataclass
class StepCounters:
    """What one step measured: wait in the collectives (s) and tokens per logical expert.

    expert_load: [L, E] choices this rank routed to each logical expert.
    """

    dispatch_wait_s: float = 0.0
    combine_wait_s: float = 0.0
    slot_tokens: int = 0
    expert_load: np.ndarray | None = None
    moe_layers: list[int] = field(default_factory=list)


def route_to_slots(
    topk_ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, slots_per_rank: int, rank_id: int
) -> torch.Tensor:
    """Pick the global slot of one replica for every (token, choice).

    topk_ids: [T, k] logical experts; log2phy: [E, R] slots of each expert (-1 padded);
    logcnt: [E] replica counts. Returns [T * k] global slot ids.
    """
    ids = topk_ids.reshape(-1)
    num_tokens, k = topk_ids.shape
    replicas = log2phy[ids]  # [N, R]
    counts = logcnt[ids].clamp(min=1)
    token_index = torch.arange(num_tokens, dtype=torch.int64).repeat_interleave(k)
    spread = replicas.gather(1, (token_index % counts)[:, None]).squeeze(1)
    local = (replicas >= 0) & (replicas // slots_per_rank == rank_id)
    has_local = local.any(dim=1)
    first_local = replicas.gather(1, local.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1)
    return torch.where(has_local, first_local, spread)


class ExpertParallelMoE:
    """The `moe_fn` of an EP rank for one epoch.

    slots: this rank's expert weights; log2phy: [L, E, R] and logcnt: [L, E] of the epoch's
    placement; group: the epoch's group (member index by rank_id via `group.members`).
    """

    def __init__(
        self,
        slots: ExpertSlots,
        log2phy: np.ndarray,
        logcnt: np.ndarray,
        group: EpochGroup,
        progress: ProgressBoard,
        moe_layers: list[int],
        num_ranks: int,
    ):
        self.slots = slots
        self.log2phy = torch.from_numpy(np.array(log2phy))
        self.logcnt = torch.from_numpy(np.array(logcnt))
        self.group = group
        self.progress = progress
        self.layer_index = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = int(logcnt.shape[1])
        index_of_rank = torch.full((num_ranks,), -1, dtype=torch.int64)
        for i, r in enumerate(group.members):
            index_of_rank[r] = i
        self.index_of_rank = index_of_rank
        self.counters = StepCounters()

    def start_step(self) -> None:
        self.counters = StepCounters(expert_load=np.zeros((len(self.layer_index), self.num_experts), dtype=np.int64))

    def moe_fn(self) -> MoEFn:
        return self._forward

    def _forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        li = self.layer_index[layer]
        group, s = self.group, self.slots.slots_per_rank
        num_tokens, k = topk_ids.shape
        hidden_size = hidden.shape[1]
        if num_tokens:
            self.counters.expert_load[li] += np.bincount(
                topk_ids.reshape(-1).numpy(), minlength=self.num_experts
            )
        slot = route_to_slots(topk_ids, self.log2phy[li], self.logcnt[li], s, group.rank_id)
        dest = self.index_of_rank[slot // s]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=group.size)
        rows = hidden.repeat_interleave(k, dim=0)[order]
        payload = torch.cat([rows.float(), (slot[order] % s).float()[:, None]], dim=1)

        self.progress.enter("dispatch", layer)
        t0 = time.perf_counter()
        recv_counts = torch.empty_like(send_counts)
        group.all_to_all(recv_counts, send_counts)
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
        received = torch.empty(sum(out_splits), hidden_size + 1)
        group.all_to_all(received, payload, out_splits, in_splits)
        self.counters.dispatch_wait_s += time.perf_counter() - t0
        self.progress.enter("compute", layer)

        w13, w2 = self.slots.layer(li)
        computed = grouped_expert_forward(
            received[:, :hidden_size].to(hidden.dtype), received[:, hidden_size].long(), w13, w2
        )
        self.counters.slot_tokens += received.shape[0]

        self.progress.enter("combine", layer)
        t0 = time.perf_counter()
        back = torch.empty(len(rows), hidden_size, dtype=computed.dtype)
        group.all_to_all(back, computed, in_splits, out_splits)
        self.counters.combine_wait_s += time.perf_counter() - t0
        self.progress.enter("compute", layer)

        expert_out = torch.empty_like(back)
        expert_out[order] = back
        return combine_weighted(expert_out, topk_weights)
