"""The two-stage all-to-all of one MoE layer (`--all2all-backend hierarchical`): gather per
host, cross hosts once between the hosts' leaders, scatter on arrival; the combine comes back
the same way. The tables are pure functions in `two_stage.py` (its docstring has the scheme).

Collectives, in the order every member posts them (A and C on the host's group, B on the
leaders' group, which only leaders post):
dispatch A counts, A rows (ranks -> leader), [B counts unless padded,] B rows (leader ->
leader), C counts, C rows (leader -> ranks); combine C' (ranks -> leader), B' (leader ->
leader), A' (leader -> ranks). Only B and B' cross hosts: one message per pair of hosts instead
of one per pair of ranks, and a token crosses to a host once, not once per choice there. The
combine's sizes are known from the dispatch, so it exchanges none.

`cap_rows` > 0 (the controller's padded dispatch, few tokens per rank): B sends fixed blocks of
`cap_rows` rows per leader (a host's tokens bound its rows for any one host), so no split sizes
cross hosts either; padding rows carry no slot.
"""

from __future__ import annotations

import torch

from .exchange import Links, Stages, pack
from .two_stage import expand_choices, host_rows, inverse, regroup


def _block_sums(values: torch.Tensor, sizes: list[int]) -> list[int]:
    """Sums of consecutive blocks of `values` [N] of the given sizes."""
    return [int(v.sum()) for v in torch.split(values, sizes)]


class TwoStageExchange:
    """hidden: [T, H]; slot: [T, k] global slot of each (token, choice); host_of_rank and
    local_of_rank: [num_ranks] host of each rank_id and its index in its host's group;
    slots_per_rank: slots of one rank; cap_rows: B's rows per leader when padded, 0 = exchange
    split sizes. The host's leader is member 0 of its host group."""

    def __init__(self, links: Links, hidden: torch.Tensor, slot: torch.Tensor, host_of_rank: torch.Tensor,
                 local_of_rank: torch.Tensor, slots_per_rank: int, cap_rows: int):
        assert links.host_group is not None, "the hierarchical exchange needs the host groups"
        self.links, self.host, self.leaders = links, links.host_group, links.leaders
        self.local_of_rank, self.s, self.cap = local_of_rank, slots_per_rank, cap_rows
        self.num_hosts = links.layout.num_hosts
        self.num_tokens, self.k = slot.shape
        self.hidden_size = hidden.shape[1]
        row_token, row_host, mask = host_rows(host_of_rank[slot // slots_per_rank], self.num_hosts)
        self.row_token, self.mask = row_token, mask
        self.rows = pack(hidden, row_token, torch.where(mask, slot[row_token], -1))  # [M, H + k]
        self.per_host = torch.bincount(row_host, minlength=self.num_hosts)

    def _only_leader(self, n: int) -> list[int]:
        """Splits with n rows to or from the host's leader and none to or from the others."""
        return [n] + [0] * (self.host.size - 1)

    def _leader_or_none(self, splits: list[int]) -> list[int]:
        """`splits` on the host's leader, nothing on its other ranks."""
        return splits if self.leaders is not None else [0] * self.host.size

    def dispatch(self) -> Stages:
        """Returns the rows for this rank's experts: [N, H + 1], last column the local slot."""
        links, host, width = self.links, self.host, self.hidden_size + self.k
        lead = self.leaders is not None
        # A: this rank's rows to its leader, with their count per destination host
        counts_a = self.per_host.new_empty(host.size * self.num_hosts if lead else 0)
        yield links.post(host, counts_a, self.per_host, self._leader_or_none([self.num_hosts] * host.size),
                         self._only_leader(self.num_hosts))
        self.counts_a = counts_a.view(-1, self.num_hosts)  # [host ranks, hosts], on the leader
        gathered = self.rows.new_empty(int(self.counts_a.sum()), width)
        yield links.post(host, gathered, self.rows, self._leader_or_none(self.counts_a.sum(1).tolist()),
                         self._only_leader(len(self.rows)))
        payload, self.scatter_splits = self.rows.new_empty(0, self.hidden_size + 1), [0] * host.size
        if lead:
            crossed = yield from self._cross(gathered)
            self.order, entry_row, entry_slot, per_rank = expand_choices(
                crossed[:, self.hidden_size:].long(), self.local_of_rank, self.s, host.size)
            payload = torch.cat([crossed[entry_row, :self.hidden_size], (entry_slot % self.s).float()[:, None]], 1)
            payload, self.scatter_splits = payload[self.order], per_rank.tolist()
        # C: one row per (token, choice) to the rank of this host that holds its slot
        count_c = torch.empty(1, dtype=torch.int64)
        yield links.post(host, count_c, torch.tensor(self.scatter_splits if lead else [], dtype=torch.int64),
                         self._only_leader(1), self._leader_or_none([1] * host.size))
        self.received_rows = int(count_c)
        received = payload.new_empty(self.received_rows, self.hidden_size + 1)
        yield links.post(host, received, payload, self._only_leader(self.received_rows), self.scatter_splits)
        return received

    def _cross(self, gathered: torch.Tensor) -> Stages:
        """B on a leader: the host's rows to each destination host's leader, once. gathered:
        [G, H + k] rank-major (each rank's rows destination-host-major). Returns what arrived."""
        links, leaders, hs = self.links, self.leaders, self.hidden_size
        valid = (gathered[:, hs:] >= 0).sum(1)
        self.valid_a = torch.tensor(_block_sums(valid, self.counts_a.reshape(-1).tolist()),
                                    dtype=torch.int64).view_as(self.counts_a)  # [host ranks, hosts] choices
        outgoing = gathered[regroup(self.counts_a)]  # destination-host-major, then rank order
        per_dest = self.counts_a.sum(0)
        if self.cap:
            assert int(per_dest.max()) <= self.cap, f"{int(per_dest.max())} rows for one host exceed {self.cap}"
            block = outgoing.new_zeros(leaders.size * self.cap, outgoing.shape[1])
            block[:, hs:] = -1
            device = per_dest.device
            at = torch.arange(len(outgoing), device=device) - torch.repeat_interleave(
                torch.cumsum(per_dest, 0) - per_dest, per_dest)
            block[torch.repeat_interleave(torch.arange(leaders.size, device=device), per_dest) * self.cap
                  + at] = outgoing
            crossed = torch.empty_like(block)
            yield links.post(leaders, crossed, block)
            recv_rows = [self.cap] * leaders.size
        else:
            incoming = torch.empty_like(per_dest)
            yield links.post(leaders, incoming, per_dest)
            recv_rows = incoming.tolist()
            crossed = outgoing.new_empty(sum(recv_rows), outgoing.shape[1])
            yield links.post(leaders, crossed, outgoing, recv_rows, per_dest.tolist())
        self.entries_per_source = _block_sums((crossed[:, hs:] >= 0).sum(1), recv_rows)
        return crossed

    def combine(self, computed: torch.Tensor) -> Stages:
        """computed: [N, H] -> expert outputs [T * k, H] in (token, choice) order."""
        links, host = self.links, self.host
        width = computed.shape[1]
        # C': computed rows back to the leader
        entries = computed.new_empty(sum(self.scatter_splits), width)
        yield links.post(host, entries, computed, self.scatter_splits, self._only_leader(self.received_rows))
        per_rank, to_ranks = computed.new_empty(0, width), [0] * host.size
        if self.leaders is not None:
            back = yield from self._uncross(entries[inverse(self.order)])
            # back is destination-host-major, then rank: reorder rank-major for A'
            per_rank, to_ranks = back[regroup(self.valid_a.T.contiguous())], self.valid_a.sum(1).tolist()
        # A': each rank's results, in the order of its rows' choices
        mine = int(self.mask.sum())
        results = computed.new_empty(mine, width)
        yield links.post(host, results, per_rank, self._only_leader(mine), to_ranks)
        expert_out = computed.new_empty(self.num_tokens * self.k, width)
        rows, choices = self.mask.nonzero(as_tuple=True)
        expert_out[self.row_token[rows] * self.k + choices] = results
        return expert_out

    def _uncross(self, entries: torch.Tensor) -> Stages:
        """B' on a leader: each source host's results back to it. entries: [P, H] row-major over
        what arrived in B. Returns the results of this host's rows, destination-host-major."""
        from_dest = self.valid_a.sum(0).tolist()
        back = entries.new_empty(sum(from_dest), entries.shape[1])
        yield self.links.post(self.leaders, back, entries, from_dest, self.entries_per_source)
        return back
