"""How one MoE layer's rows travel: the epoch's groups as the all-to-alls use them (`Links`),
and the flat exchanges over the whole group (the two-stage one is in `hierarchical.py`).

An exchange is two generators, `dispatch()` and `combine(computed)`: each posts one collective at
a time and yields it (`Posted`) to the caller, who waits for it when it chooses and resumes the
generator, which posts the next. That is what lets two micro-batches interleave their
collectives with each other's compute (runtime/ep_moe.py), and one micro-batch run them back to
back. Every member posts the same collectives in the same order; an exchange with no rows of
its own still posts all of them.

Flat layouts: exchange split sizes then the rows (three collectives per layer: `CountedExchange`),
or fixed blocks of `cap` rows per peer (two: `PaddedExchange`), used when the controller sees
that every rank runs few tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from .group import EpochGroup, Posted
from .two_stage import HostLayout

Stages = Generator[Posted, None, torch.Tensor]


class Links:
    """This rank's groups in one epoch: the whole group, and for the hierarchical all-to-all its
    host's group and (on a host's leader) the leaders' group, plus what its sends put on links
    between hosts (`remote_messages`, `remote_bytes`: point-to-point sends to a member on another
    host, as gloo makes them: one per peer per collective, empty ones included)."""

    def __init__(self, group: EpochGroup, layout: HostLayout, hierarchical: bool = False,
                 host_group: EpochGroup | None = None, leaders: EpochGroup | None = None):
        self.group = group
        self.layout = layout
        self.hierarchical = hierarchical
        self.host_group = host_group
        self.leaders = leaders
        self.host_of = dict(zip(group.members, layout.host_of, strict=True))
        self.my_host = self.host_of[group.rank_id]
        self.remote_messages = 0
        self.remote_bytes = 0

    @classmethod
    def form(cls, group: EpochGroup, nodes: list[str], backend: str, superseded: Callable[[], bool]) -> Links:
        """The links of a formed epoch group. nodes: the node of each member (empty: one host).
        backend "hierarchical" forms the host and leaders' groups when the members span more
        than one host; otherwise every exchange is flat. Raises as `EpochGroup.subgroup`."""
        layout = HostLayout.of(nodes or ["local"] * group.size)
        if backend != "hierarchical" or layout.num_hosts == 1:
            return cls(group, layout)
        mine = layout.host_of[group.index]
        host_group = group.subgroup(f"host{mine}", [group.members[m] for m in layout.hosts[mine]], superseded)
        leaders = None
        if layout.leaders[mine] == group.index:
            leaders = group.subgroup("leaders", [group.members[m] for m in layout.leaders], superseded)
        return cls(group, layout, True, host_group, leaders)

    def post(self, group: EpochGroup, output: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
             in_splits: list[int] | None = None) -> Posted:
        """`group.post_all_to_all`, counting what it sends to other hosts. inp: [N, ...] rows."""
        row_bytes = inp[0:1].numel() * inp.element_size() if inp.dim() else inp.element_size()
        rows = in_splits or [inp.shape[0] // group.size] * group.size
        for rank_id, n in zip(group.members, rows, strict=True):
            if self.host_of[rank_id] != self.my_host:
                self.remote_messages += 1
                self.remote_bytes += n * row_bytes
        return group.post_all_to_all(output, inp, out_splits, in_splits)


def pack(hidden: torch.Tensor, token_of_row: torch.Tensor, slot_columns: torch.Tensor) -> torch.Tensor:
    """Rows to send: hidden[token_of_row] as float32 with the slot columns appended.

    hidden: [T, H]; token_of_row: [N]; slot_columns: [N, c] (exact as float below 2^24) -> [N, H + c]."""
    return torch.cat([hidden[token_of_row].float(), slot_columns.float()], dim=1)


class CountedExchange:
    """Split sizes, then the rows, then the combine: over the whole group.

    hidden: [T, H]; dest: [T * k] member index of each (token, choice); local_slot: [T * k] slot
    within the destination rank.
    """

    def __init__(self, links: Links, hidden: torch.Tensor, dest: torch.Tensor, local_slot: torch.Tensor, k: int):
        self.links, self.group = links, links.group
        self.order = torch.argsort(dest, stable=True)
        self.payload = pack(hidden, self.order // k, local_slot[self.order, None])
        self.send_counts = torch.bincount(dest, minlength=self.group.size)

    def dispatch(self) -> Stages:
        """Returns the rows for this rank's experts: [N, H + 1], last column the local slot."""
        recv_counts = torch.empty_like(self.send_counts)
        posted = self.links.post(self.group, recv_counts, self.send_counts)
        yield posted
        self.in_splits, self.out_splits = self.send_counts.tolist(), recv_counts.tolist()
        received = self.payload.new_empty(sum(self.out_splits), self.payload.shape[1])
        yield self.links.post(self.group, received, self.payload, self.out_splits, self.in_splits)
        return received

    def combine(self, computed: torch.Tensor) -> Stages:
        """computed: [N, H] -> expert outputs [T * k, H] in (token, choice) order."""
        back = computed.new_empty(self.payload.shape[0], computed.shape[1])
        yield self.links.post(self.group, back, computed, self.in_splits, self.out_splits)
        expert_out = torch.empty_like(back)
        expert_out[self.order] = back
        return expert_out


class PaddedExchange:
    """One exchange of fixed-size blocks: `cap` rows per peer, which the controller sized from
    the busiest rank's tokens, so no split sizes are exchanged (DP token padding). Padding rows carry slot -1.
    Arguments as `CountedExchange`."""

    def __init__(self, links: Links, hidden: torch.Tensor, dest: torch.Tensor, local_slot: torch.Tensor, k: int,
                 cap: int):
        self.links, self.group = links, links.group
        order = torch.argsort(dest, stable=True)
        dest_sorted = dest[order]
        counts = torch.bincount(dest_sorted, minlength=self.group.size)
        assert int(counts.max()) <= cap, f"{int(counts.max())} rows for one peer exceed {cap}"
        position = torch.arange(len(dest_sorted), device=dest.device) - (torch.cumsum(counts, 0) - counts)[dest_sorted]
        self.index = dest_sorted * cap + position
        self.order = order
        payload = pack(hidden, order // k, local_slot[order, None])
        self.block = payload.new_zeros(self.group.size * cap, payload.shape[1])
        self.block[:, -1] = -1
        self.block[self.index] = payload

    def dispatch(self) -> Stages:
        received = torch.empty_like(self.block)
        yield self.links.post(self.group, received, self.block)
        return received

    def combine(self, computed: torch.Tensor) -> Stages:
        back = torch.empty_like(computed)
        yield self.links.post(self.group, back, computed)
        expert_out = torch.empty(len(self.order), computed.shape[1], dtype=computed.dtype, device=computed.device)
        expert_out[self.order] = back[self.index]
        return expert_out
