"""The two-stage all-to-all's pure tables and the micro-batch split, without processes (the
exchanges themselves run on real gloo groups in test_ep_moe.py)."""

from __future__ import annotations

import torch

from elastic_ep.model.model import SeqChunk
from elastic_ep.runtime.overlap import split_chunks
from elastic_ep.runtime.two_stage import HostLayout, expand_choices, host_rows, inverse, regroup


def test_host_layout_groups_members_by_node_in_member_order():
    layout = HostLayout.of(["b", "a", "b", "c", "a"])
    assert layout.hosts == ((0, 2), (1, 4), (3,))
    assert layout.leaders == [0, 1, 3] and layout.host_of == (0, 1, 0, 2, 1)
    assert layout.host_of_ranks([5, 1, 7, 2, 0], 8).tolist() == [1, 1, 2, -1, -1, 0, -1, 0]


def test_a_token_crosses_to_a_host_once_however_many_of_its_choices_live_there():
    # 3 tokens, k = 3: token 0 has all choices on host 1; token 1 on hosts 0 and 1; token 2 on host 0
    dest_host = torch.tensor([[1, 1, 1], [0, 1, 0], [0, 0, 0]])
    row_token, row_host, mask = host_rows(dest_host, 2)
    assert row_token.tolist() == [1, 2, 0, 1] and row_host.tolist() == [0, 0, 1, 1]
    assert mask.tolist() == [[True, False, True], [True] * 3, [True] * 3, [False, True, False]]
    assert host_rows(torch.empty(0, 3, dtype=torch.int64), 2)[0].numel() == 0


def test_regroup_orders_source_major_rows_destination_major_and_back():
    # source 0: x0 (to 0), x1 x2 (to 1); source 1: y0 (to 0), nothing to 1
    counts = torch.tensor([[1, 2], [1, 0]])
    rows = ["x0", "x1", "x2", "y0"]
    index = regroup(counts)
    assert [rows[i] for i in index] == ["x0", "y0", "x1", "x2"]
    assert torch.equal(torch.arange(4)[index][inverse(index)], torch.arange(4))


def test_arrivals_scatter_one_entry_per_choice_to_the_rank_holding_its_slot():
    # 2 slots per rank; this host holds ranks 4 (local 0) and 6 (local 1)
    local_of_rank = torch.tensor([-1, -1, -1, -1, 0, -1, 1, -1])
    slots = torch.tensor([[13, -1, 8], [-1, 9, -1]])  # slot 13 is rank 6's, 8 and 9 rank 4's
    order, entry_row, entry_slot, counts = expand_choices(slots, local_of_rank, 2, 2)
    assert entry_row.tolist() == [0, 0, 1] and entry_slot.tolist() == [13, 8, 9]
    assert entry_slot[order].tolist() == [8, 9, 13] and counts.tolist() == [2, 1]


def test_micro_batches_split_tokens_evenly_and_cut_a_prefill_in_two():
    chunks = [SeqChunk(1, [5], 9), SeqChunk(2, list(range(6)), 0), SeqChunk(3, [7], 4)]
    batches, ends = split_chunks(chunks, 2)
    assert [[(c.seq_id, c.start_pos, len(c.token_ids)) for c in b] for b in batches] == [
        [(1, 9, 1), (2, 0, 3)], [(2, 3, 3), (3, 4, 1)]]
    assert ends == [(0, 0), (1, 0), (1, 1)]  # sequence 2's logits come from its second piece
    assert split_chunks([SeqChunk(1, [5], 0)], 2) == ([[SeqChunk(1, [5], 0)], []], [(0, 0)])
    assert split_chunks([], 2) == ([[], []], [])
