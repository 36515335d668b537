"""Pure tables of the two-stage (hierarchical) all-to-all: which members share a host, which
rows cross hosts and in what order. No process groups here; `hierarchical.py` moves the rows.

The scheme (DeepEP's internode kernels do the same across NVLink and RDMA):
a token bound for experts on another host crosses to that host once, however many of its top-k
choices live there, carrying the k destination slots (-1 where a choice is elsewhere):
1. each rank hands its rows to its host's leader (one row per token and destination host);
2. the leaders exchange them, one message per pair of hosts;
3. each leader scatters what arrived, one row per (token, choice), to the ranks of its host.
The combine runs the same way back, one row per (token, choice): the k outputs of a token are
summed only on its own rank, in the same order as everywhere else, so greedy output stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostLayout:
    """Which members of an epoch share a host.

    hosts: the member indices of each host, hosts in the order of their lowest member; the first
    member of a host is its leader. host_of: the host index of each member index.
    """

    hosts: tuple[tuple[int, ...], ...]
    host_of: tuple[int, ...]

    @classmethod
    def of(cls, nodes: list[str]) -> HostLayout:
        """nodes: the node (host) of each member, in member order. Raises ValueError when empty."""
        if not nodes:
            raise ValueError("an epoch has at least one member")
        order: dict[str, list[int]] = {}
        for index, node in enumerate(nodes):
            order.setdefault(node, []).append(index)
        hosts = tuple(tuple(members) for members in order.values())
        host_of = [0] * len(nodes)
        for h, members in enumerate(hosts):
            for m in members:
                host_of[m] = h
        return cls(hosts, tuple(host_of))

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def leaders(self) -> list[int]:
        return [members[0] for members in self.hosts]

    def host_of_ranks(self, members: list[int], num_ranks: int) -> torch.Tensor:
        """[num_ranks] host index of each rank_id (members: rank_ids in member order), -1 for a
        rank outside the epoch."""
        out = torch.full((num_ranks,), -1, dtype=torch.int64)
        for index, rank_id in enumerate(members):
            out[rank_id] = self.host_of[index]
        return out


def host_rows(dest_host: torch.Tensor, num_hosts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per (token, destination host), host-major, tokens in order within a host.

    dest_host: [T, k] host of each (token, choice). Returns row_token [M], row_host [M] and
    choice_mask [M, k] (which of the token's choices the row carries to its host).
    """
    num_tokens, k = dest_host.shape
    present = torch.zeros(num_hosts, num_tokens, dtype=torch.bool, device=dest_host.device)
    if num_tokens:
        present[dest_host.reshape(-1), torch.arange(num_tokens, device=dest_host.device).repeat_interleave(k)] = True
    row_host, row_token = present.nonzero(as_tuple=True)
    return row_token, row_host, dest_host[row_token] == row_host[:, None]


def regroup(counts: torch.Tensor) -> torch.Tensor:
    """Reorder source-major rows to destination-major.

    counts: [S, D] rows of source s for destination d; the input lists source 0's rows (its
    destination 0 rows, then 1, ...), then source 1's. Returns index [counts.sum()] such that
    rows[index] lists destination 0's rows (source 0's, then source 1's, ...), then destination 1's.
    """
    sources, dests = counts.shape
    starts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).reshape(sources, dests)
    pieces = [torch.arange(int(starts[s, d]), int(starts[s, d] + counts[s, d]), dtype=torch.int64)
              for d in range(dests) for s in range(sources)]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)


def inverse(index: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `rows[index]`: rows[index][inverse(index)] == rows."""
    out = torch.empty_like(index)
    out[index] = torch.arange(len(index), dtype=index.dtype, device=index.device)
    return out


def expand_choices(slots: torch.Tensor, local_of_rank: torch.Tensor, slots_per_rank: int, host_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """On arrival at a host: one entry per (row, choice) that has a slot, by the local rank that
    holds it.

    slots: [N, k] global slot of each choice, -1 where the choice is on another host;
    local_of_rank: [num_ranks] index within this host of each rank_id. Entries are numbered
    row-major (rows, then choices). Returns order [P] (entries sorted by local rank, stable),
    entry_row [P] and entry_slot [P] (row-major) and counts [host_size] of entries per local rank.
    """
    rows, choices = (slots >= 0).nonzero(as_tuple=True)
    entry_slot = slots[rows, choices]
    local = local_of_rank[entry_slot // slots_per_rank]
    return torch.argsort(local, stable=True), rows, entry_slot, torch.bincount(local, minlength=host_size)
