"""A step's tokens kept as each rank answered them (control/serving/sampled.py): a rank's decode
rows get their tokens as a slice of its answer only where the answer ends with those rows as
planned, and are looked up in that rank's answer otherwise."""

from __future__ import annotations

from elastic_ep.control.serving.sampled import Sampled


def test_decode_rows_get_the_slice_of_their_ranks_answer_after_the_chunks():
    sampled = Sampled()
    sampled.add(0, [7, 1, 2, 3], [70, 10, 20, 30])  # a chunk's token (seq 7), then decode rows 1, 2, 3
    sampled.add(1, [4], [40])
    assert sampled.row_tokens(0, [1, 2, 3]) == ([10, 20, 30], True)
    assert sampled.row_tokens(1, [4]) == ([40], True)
    assert len(sampled) == 5 and sampled.lookup(0)[7] == 70


def test_an_answer_not_as_planned_is_looked_up_in_its_rank_only():
    sampled = Sampled()
    sampled.add(0, [1, 3], [10, 30])  # row 2's sampling failed: its token is missing
    sampled.add(1, [2], [99])  # another rank's token of the same seq_id is not rank 0's
    assert sampled.row_tokens(0, [1, 2, 3]) == ([10, None, 30], False)
    sampled.add(2, [6, 5], [60, 50])  # in another order
    assert sampled.row_tokens(2, [5, 6]) == ([50, 60], True)
    assert sampled.row_tokens(3, [8]) == ([None], False)  # no answer
    assert sampled.row_tokens(0, [3, 1]) == ([30, 10], True)  # as long as the answer, another order
    assert dict(sampled.lookup(0)) == {1: 10, 3: 30} and sampled.lookup(1)[2] == 99


def test_unranked_tokens_are_every_ranks_lookup():
    sampled = Sampled.unranked({1: 10, 2: 20})
    assert len(sampled) == 2 and sampled.lookup(5)[2] == 20
    assert sampled.row_tokens(5, [2, 1, 3]) == ([20, 10, None], False)
