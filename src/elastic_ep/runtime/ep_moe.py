"""Expert parallelism for one step: route each (token, choice) to one replica of its expert,
dispatch the rows (`exchange.py` flat, `hierarchical.py` two-stage), run the experts of this
rank's slots, combine back, for every MoE layer of one or two micro-batches.

`ExpertParallelMoE.run` drives each micro-batch's forward (`model.forward_stages`) as a task
that runs until it posts its next collective; the tasks take turns, waiting for one's collective
while the others compute, so with two micro-batches (`--enable-dbo`) one's all-to-all is in
flight during the other's attention and experts. With one micro-batch it is the plain sequence.
Every rank posts the same collectives in the same order: the same micro-batch count and layout
on every rank (the step plan says), a task per micro-batch even with no tokens.

Replica choice is deterministic: a replica on this rank if there is one (no network), else one
on this rank's host, spread by `token_index % count`, else any, spread the same way.

After an error in this rank's own computation (attention, routing, its experts) the task that
raised goes on with nothing to send, so its peers never wait on it: the layer in flight is
combined with zeros when the error came from the experts, the remaining layers run empty
(still computing the rows peers send here); `run` raises `LocalFailure` once every collective of
the step has run. A failed collective raises CollectiveError at once: the group is broken.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import torch

from elastic_ep.model.model import MoECall
from elastic_ep.model.moe import combine_weighted, grouped_expert_forward

from .exchange import CountedExchange, Links, PaddedExchange
from .experts import ExpertSlots
from .group import CollectiveError, ProgressBoard
from .hierarchical import TwoStageExchange

Forward = Generator[MoECall, torch.Tensor, torch.Tensor]


@dataclass
class StepCounters:
    """What one step measured: wait in the collectives (s), tokens per logical expert, and what
    this rank sent to other hosts (point-to-point messages and bytes, see `Links`).

    expert_load: [L, E] choices this rank routed to each logical expert.
    """

    dispatch_wait_s: float = 0.0
    combine_wait_s: float = 0.0
    slot_tokens: int = 0
    expert_load: np.ndarray | None = None
    remote_messages: int = 0
    remote_bytes: int = 0


class LocalFailure(Exception):
    """This rank's own computation raised during the step (every collective still ran).
    in_experts: it raised in the experts of a dispatched layer, so peers got zeros back."""

    def __init__(self, error: Exception, in_experts: bool):
        super().__init__(str(error))
        self.error, self.in_experts = error, in_experts


@dataclass
class _TaskState:
    """Where one micro-batch's task is: MoE layers combined, the exchange whose rows it holds
    (dispatched, not yet combined) and their count, and whether it is inside an exchange."""

    layers_done: int = 0
    open: tuple | None = None
    in_exchange: bool = False
    finishing: bool = False  # it failed once and runs the rest empty
    pad_rows: int = 0  # its last rows are the step's padding: computed, not counted in the expert load


def route_to_slots(topk_ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, slots_per_rank: int,
                   rank_id: int, host_of_rank: torch.Tensor | None = None) -> torch.Tensor:
    """Pick the global slot of one replica for every (token, choice).

    topk_ids: [T, k] logical experts; log2phy: [E, R] slots of each expert (-1 padded, valid
    first); logcnt: [E] replica counts; host_of_rank: [num_ranks] host of each rank_id (None:
    one host). Returns [T * k] global slot ids.
    """
    ids = topk_ids.reshape(-1)
    num_tokens, k = topk_ids.shape
    replicas = log2phy[ids]  # [N, R]
    valid = replicas >= 0
    owner = torch.where(valid, replicas // slots_per_rank, -1)
    token_index = torch.arange(num_tokens, dtype=torch.int64, device=topk_ids.device).repeat_interleave(k)
    near = valid if host_of_rank is None else valid & (host_of_rank[owner.clamp(min=0)] == host_of_rank[rank_id])
    pool = torch.where(near.any(dim=1, keepdim=True), near, valid)
    pick = token_index % pool.sum(dim=1).clamp(min=1)
    chosen = (pool & (pool.cumsum(dim=1) - 1 == pick[:, None])).to(torch.int8).argmax(dim=1)
    spread = replicas.gather(1, chosen[:, None]).squeeze(1)
    local = valid & (owner == rank_id)
    first_local = replicas.gather(1, local.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1)
    return torch.where(local.any(dim=1), first_local, spread)


class ExpertParallelMoE:
    """The MoE layers of an EP rank for one epoch.

    slots: this rank's expert weights; log2phy: [L, E, R] and logcnt: [L, E] of the epoch's
    placement; links: the epoch's groups (`Links`); moe_layers: the model's MoE layer ids;
    top_k: the model's choices per token (sizes the padded dispatch alike on every rank).
    """

    def __init__(self, slots: ExpertSlots, log2phy: np.ndarray, logcnt: np.ndarray, links: Links,
                 progress: ProgressBoard, moe_layers: list[int], num_ranks: int, top_k: int):
        self.slots, self.links, self.group, self.progress = slots, links, links.group, progress
        self.top_k = top_k
        device = slots.device  # where routing and the experts run; the group stages to its own device
        self.log2phy = torch.from_numpy(np.array(log2phy)).to(device)
        self.logcnt = torch.from_numpy(np.array(logcnt)).to(device)
        self.layer_index = {layer: i for i, layer in enumerate(moe_layers)}
        self.moe_layers = list(moe_layers)
        self.num_experts = int(logcnt.shape[1])
        self.hidden_size = int(slots.w13[0].shape[2])
        members = self.group.members
        self.index_of_rank = torch.full((num_ranks,), -1, dtype=torch.int64)
        for i, r in enumerate(members):
            self.index_of_rank[r] = i
        self.index_of_rank = self.index_of_rank.to(device)
        self.host_of_rank = links.layout.host_of_ranks(members, num_ranks).to(device)
        self.local_of_rank = torch.full((num_ranks,), -1, dtype=torch.int64)
        if links.host_group is not None:
            for i, r in enumerate(links.host_group.members):
                self.local_of_rank[r] = i
        self.local_of_rank = self.local_of_rank.to(device)
        self.max_host_size = max(len(h) for h in links.layout.hosts)
        self.counters = StepCounters()
        self.busiest_per_micro_batch = 0  # padded dispatch: tokens bounding every micro-batch of the step, 0 = counted
        self.fail_in_experts = False  # fault injection: raise in the experts of this step's first dispatched layer
        self.fail_local_at = -1  # fault injection: raise before dispatching this MoE layer id
        # the readiness gate's warm-up (`warm_up`): [L, S] slots of this rank that computed tokens, None when serving
        self.warmed: np.ndarray | None = None
        self._group_slots = torch.tensor([r * slots.slots_per_rank + j for r in sorted(members)
                                          for j in range(slots.slots_per_rank)], dtype=torch.int64, device=device)

    def start_step(self, dispatch_rows: int = 0, micro_batches: int = 1) -> None:
        """dispatch_rows: rows per peer of the padded dispatch this step (the busiest rank's tokens
        x top-k), 0 = exchange split sizes; each of `micro_batches` gets its share."""
        busiest = dispatch_rows // self.top_k
        self.busiest_per_micro_batch = -(-busiest // micro_batches)  # a micro-batch has at most its share
        self.fail_in_experts, self.fail_local_at = False, -1
        self.links.remote_messages = self.links.remote_bytes = 0
        self.counters = StepCounters(expert_load=np.zeros((len(self.layer_index), self.num_experts), dtype=np.int64))

    def warm_up(self, on: bool) -> int:
        """Route every (token, choice) round robin over the group's slots (on), or as the router
        says again (off: returns how many of this rank's slots, over every MoE layer, computed
        tokens meanwhile)."""
        warmed = 0 if self.warmed is None else int(self.warmed.sum())
        self.warmed = np.zeros((len(self.moe_layers), self.slots.slots_per_rank), dtype=bool) if on else None
        return warmed

    def _cover(self, num_pairs: int) -> torch.Tensor:
        """[num_pairs] global slots for a warm-up: this rank's pairs follow those of the members before
        it, round robin over every slot of the group, so R ranks of T tokens x k cover min(R*T*k, slots)."""
        start = self.group.members.index(self.group.rank_id) * num_pairs
        index = (torch.arange(num_pairs, device=self._group_slots.device) + start) % len(self._group_slots)
        return self._group_slots[index]

    def run(self, forwards: list[Forward], pad_rows: list[int] | None = None) -> list[torch.Tensor]:
        """Drive each micro-batch's forward to its end; returns their logits in order. pad_rows:
        per forward, how many of its last tokens are padding (left out of the expert load). Raises
        CollectiveError when a collective fails, LocalFailure after an error in this rank's own
        computation (once the step's collectives have all run)."""
        n = len(forwards)
        states = [_TaskState(pad_rows=pad) for pad in (pad_rows or [0] * n)]
        tasks = [self._task(f, s) for f, s in zip(forwards, states, strict=True)]
        pending: list = [None] * n
        results: list = [None] * n
        failures: list[LocalFailure] = []

        def advance(i: int) -> None:
            while True:
                try:
                    pending[i] = tasks[i].send(None)
                    return
                except StopIteration as done:
                    pending[i], results[i] = None, done.value
                    return
                except CollectiveError:
                    raise
                except Exception as e:
                    state = states[i]
                    # an exchange half done, or an empty layer that fails, cannot go on in step with the peers
                    if state.in_exchange or (state.finishing and state.open is None):
                        raise CollectiveError(f"rank {self.group.rank_id} cannot finish the step's all-to-alls: "
                                              f"{type(e).__name__}: {e}") from e
                    failures.append(LocalFailure(e, state.open is not None))
                    state.finishing = True
                    tasks[i] = self._finish_empty(state)

        for i in range(n):
            advance(i)
        while any(p is not None for p in pending):
            for i in range(n):
                if pending[i] is None:
                    continue
                posted, phase = pending[i]
                finish_queued_work(self.slots.device)
                t0 = time.perf_counter()
                posted.wait()
                waited = time.perf_counter() - t0
                if phase == "dispatch":
                    self.counters.dispatch_wait_s += waited
                else:
                    self.counters.combine_wait_s += waited
                advance(i)
        self.counters.remote_messages, self.counters.remote_bytes = self.links.remote_messages, self.links.remote_bytes
        if failures:
            raise failures[0]
        return results

    def run_empty(self, micro_batches: int) -> None:
        """Every collective of a step with no tokens (this rank failed before its forward)."""
        try:
            self.run([self._empty_forward(0) for _ in range(micro_batches)])
        except LocalFailure:
            pass

    def _task(self, forward: Forward, state: _TaskState):
        """One micro-batch: its forward, with each MoE layer's exchange and experts. Yields
        (Posted, phase) for every collective it posts; returns the forward's result."""
        routed = None
        while True:
            try:
                call = forward.send(routed)
            except StopIteration as done:
                return done.value
            if call.layer == self.fail_local_at:
                self.fail_local_at = -1
                raise RuntimeError(f"injected fault: local computation of layer {call.layer} failed")
            exchange = self._exchange(call, state.pad_rows)
            self.progress.enter("dispatch", call.layer)
            state.in_exchange = True
            received = yield from _tagged(exchange.dispatch(), "dispatch")
            state.in_exchange, state.open = False, (exchange, received.shape[0])
            computed = self._experts(call.layer, received, call.hidden.dtype)
            routed = combine_weighted((yield from self._combine(state, computed)), call.topk_weights)

    def _combine(self, state: _TaskState, computed: torch.Tensor):
        """Combine the open layer of a task; the layer is done afterwards."""
        exchange, _ = state.open
        self.progress.enter("combine", self.moe_layers[state.layers_done])
        state.in_exchange = True
        expert_out = yield from _tagged(exchange.combine(computed), "combine")
        state.in_exchange, state.open = False, None
        state.layers_done += 1
        self.progress.enter("compute", self.moe_layers[state.layers_done - 1])
        return expert_out

    def _finish_empty(self, state: _TaskState):
        """A task's remaining collectives after its own computation raised: the open layer
        combined with zeros, then every remaining layer with no tokens of its own."""
        if state.open is not None:
            yield from self._combine(state, torch.zeros(state.open[1], self.hidden_size, dtype=self.slots.w13[0].dtype,
                                                        device=self.slots.device))
        return (yield from self._task(self._empty_forward(state.layers_done), state))

    def _empty_forward(self, first: int) -> Forward:
        """A forward with no tokens from MoE layer index `first` on."""
        device, dtype = self.slots.device, self.slots.w13[0].dtype
        for layer in self.moe_layers[first:]:
            yield MoECall(layer, torch.empty(0, self.hidden_size, dtype=dtype, device=device),
                          torch.empty(0, 1, dtype=torch.int64, device=device), torch.empty(0, 1, device=device))
        return None

    def _exchange(self, call: MoECall, pad_rows: int = 0):
        """Route one layer's (token, choice) pairs and pack the exchange that moves them; the last
        `pad_rows` tokens (padding) are routed too but left out of the expert load."""
        li = self.layer_index[call.layer]
        num_tokens, k = call.topk_ids.shape
        if num_tokens > pad_rows:
            self.counters.expert_load[li] += torch.bincount(call.topk_ids[:num_tokens - pad_rows].reshape(-1),
                                                            minlength=self.num_experts).cpu().numpy()
        s = self.slots.slots_per_rank
        slot = route_to_slots(call.topk_ids, self.log2phy[li], self.logcnt[li], s, self.group.rank_id,
                              self.host_of_rank) if self.warmed is None else self._cover(num_tokens * k)
        busiest = self.busiest_per_micro_batch
        if self.links.hierarchical:
            return TwoStageExchange(self.links, call.hidden, slot.view(num_tokens, k), self.host_of_rank,
                                    self.local_of_rank, s, busiest * self.max_host_size)
        dest = self.index_of_rank[slot // s]
        if busiest:
            return PaddedExchange(self.links, call.hidden, dest, slot % s, k, busiest * self.top_k)
        return CountedExchange(self.links, call.hidden, dest, slot % s, k)

    def _experts(self, layer: int, received: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """received: [N, H + 1] rows with their local slot (-1: padding) -> outputs [N, H]."""
        if self.fail_in_experts:
            self.fail_in_experts = False
            raise RuntimeError(f"injected fault: expert computation of layer {layer} failed")
        w13, w2 = self.slots.layer(self.layer_index[layer])
        h = self.hidden_size
        slot_ids = received[:, h].long()
        valid = slot_ids >= 0
        computed = torch.zeros(received.shape[0], h, dtype=dtype, device=received.device)
        computed[valid] = grouped_expert_forward(received[valid, :h].to(dtype), slot_ids[valid], w13, w2)
        self.counters.slot_tokens += int(valid.sum())
        if self.warmed is not None:
            self.warmed[self.layer_index[layer], slot_ids[valid].unique().cpu().numpy()] = True
        return computed


def finish_queued_work(device: torch.device) -> None:
    """Wait for this rank's computation still queued on `device` (a GPU runs it after the launch
    returns), so that the time spent next in a collective is waiting on peers only: the straggler
    policy reads a rank's compute time as its step minus these waits, and a slow GPU's kernels
    must count as its compute. Nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _tagged(stages, phase: str):
    """Yield (Posted, phase) for each collective an exchange generator posts; return its result."""
    while True:
        try:
            posted = next(stages)
        except StopIteration as done:
            return done.value
        yield posted, phase
