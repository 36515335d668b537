"""Expert parallelism for one MoE layer: route each (token, choice) to one replica of its
expert, dispatch with all_to_all_single, run the experts of this rank's slots, combine back.

Two dispatch layouts, the same on every rank of a step: exchange split sizes then the rows
(three collectives per layer), or fixed blocks of `dispatch_rows` rows per peer (two), used
when the controller sees that every rank runs few tokens (decode).

Replica choice is deterministic: a replica on this rank if there is one (no network), else
replica `token_index % replica_count`, which spreads a hot expert's tokens over its replicas.
Every rank runs the collectives of every layer even with zero tokens, which is what keeps the
group in step; after an error in its own computation a rank finishes the step's remaining
collectives with nothing to send (`finish_collectives`), so its peers never wait on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

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
        self.moe_layers = list(moe_layers)
        self.counters = StepCounters()
        self.dispatch_rows = 0
        self.layers_done = 0
        self._open: Callable[[], None] | None = None  # combines the dispatched layer with zeros
        self.fail_in_experts = False  # fault injection: raise between this step's first dispatch and combine

    def start_step(self, dispatch_rows: int = 0) -> None:
        """dispatch_rows: rows per peer of the padded dispatch this step, 0 = exchange split sizes."""
        self.dispatch_rows = dispatch_rows
        self.layers_done = 0
        self._open = None
        self.fail_in_experts = False
        self.counters = StepCounters(expert_load=np.zeros((len(self.layer_index), self.num_experts), dtype=np.int64))

    @property
    def in_experts(self) -> bool:
        """A layer is dispatched and not yet combined: an error now would send peers zeros."""
        return self._open is not None

    def finish_collectives(self, hidden_size: int) -> None:
        """After an error in this rank's own computation: combine the layer in flight with zeros,
        then run every remaining MoE layer of the step with no tokens, so the peers complete
        the step. Raises CollectiveError when a collective fails."""
        if self._open is not None:
            self._open()
        empty = torch.empty(0, hidden_size)
        for layer in self.moe_layers[self.layers_done:]:
            self._forward(layer, empty, torch.empty(0, 1, dtype=torch.int64), torch.empty(0, 1))

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
        rows = hidden[order // k]  # (token, choice) n is token n // k: one gather, no k-fold copy first
        payload = torch.cat([rows.float(), (slot[order] % s).float()[:, None]], dim=1)

        self.progress.enter("dispatch", layer)
        t0 = time.perf_counter()
        if self.dispatch_rows:
            received, back_to_rows = self._dispatch_padded(payload, dest[order])
        else:
            received, back_to_rows = self._dispatch_counted(payload, dest)
        self.counters.dispatch_wait_s += time.perf_counter() - t0
        self.progress.enter("compute", layer)
        self._open = lambda: self._combine(layer, back_to_rows,
                                           torch.zeros(received.shape[0], hidden_size, dtype=hidden.dtype))

        if self.fail_in_experts:
            self.fail_in_experts = False
            raise RuntimeError(f"injected fault: expert computation of layer {layer} failed")
        w13, w2 = self.slots.layer(li)
        slot_ids = received[:, hidden_size].long()
        valid = slot_ids >= 0
        computed = torch.zeros(received.shape[0], hidden_size, dtype=hidden.dtype)
        computed[valid] = grouped_expert_forward(received[valid, :hidden_size].to(hidden.dtype), slot_ids[valid], w13, w2)
        self.counters.slot_tokens += int(valid.sum())

        back = self._combine(layer, back_to_rows, computed)

        expert_out = torch.empty_like(back)
        expert_out[order] = back
        return combine_weighted(expert_out, topk_weights)

    def _combine(self, layer: int, back_to_rows, computed: torch.Tensor) -> torch.Tensor:
        """The combine all-to-all of a dispatched layer; the layer is done afterwards."""
        self._open = None
        self.progress.enter("combine", layer)
        t0 = time.perf_counter()
        back = back_to_rows(computed)
        self.counters.combine_wait_s += time.perf_counter() - t0
        self.progress.enter("compute", layer)
        self.layers_done += 1
        return back

    def _dispatch_counted(self, payload: torch.Tensor, dest: torch.Tensor):
        """Exchange split sizes, then the rows. payload: [N, H+1] sorted by destination."""
        group = self.group
        send_counts = torch.bincount(dest, minlength=group.size)
        recv_counts = torch.empty_like(send_counts)
        group.all_to_all(recv_counts, send_counts)
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
        received = torch.empty(sum(out_splits), payload.shape[1])
        group.all_to_all(received, payload, out_splits, in_splits)

        def back_to_rows(computed: torch.Tensor) -> torch.Tensor:
            back = torch.empty(payload.shape[0], computed.shape[1], dtype=computed.dtype)
            group.all_to_all(back, computed, in_splits, out_splits)
            return back

        return received, back_to_rows

    def _dispatch_padded(self, payload: torch.Tensor, dest_sorted: torch.Tensor):
        """One exchange of fixed-size blocks: `dispatch_rows` rows per peer, which the
        controller sized from the busiest rank's tokens, so no split sizes are exchanged
        (DP token padding, seed 000 section 3). Padding rows carry slot -1."""
        group, cap = self.group, self.dispatch_rows
        counts = torch.bincount(dest_sorted, minlength=group.size)
        assert int(counts.max()) <= cap, f"{int(counts.max())} rows for one peer exceed {cap}"
        position = torch.arange(len(dest_sorted)) - (torch.cumsum(counts, 0) - counts)[dest_sorted]
        index = dest_sorted * cap + position
        block = torch.zeros(group.size * cap, payload.shape[1])
        block[:, -1] = -1
        block[index] = payload
        received = torch.empty_like(block)
        group.all_to_all(received, block)

        def back_to_rows(computed: torch.Tensor) -> torch.Tensor:
            back = torch.empty_like(computed)
            group.all_to_all(back, computed)
            return back[index]

        return received, back_to_rows
