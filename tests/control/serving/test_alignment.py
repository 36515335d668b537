"""Per-step DP alignment: the step's level, the decode balance rule, and the scheduler applying
them (tokens per rank evened, unstarted prefills re-placed, a decoding sequence moved by KV copy
or re-prefill and re-homed only when its step commits)."""

from __future__ import annotations

import pytest
from test_scheduler import prompt_seq, run_step, seq

from elastic_ep.control.serving.alignment import AlignRule, DecodeBalance, imbalance, rank_caps
from elastic_ep.control.serving.scheduler import Scheduler


def test_prefill_is_cut_to_the_mean_while_other_ranks_decode():
    # rank 0 starts a 200-token prompt while every rank decodes 3 sequences
    caps = rank_caps({0: 3, 1: 3, 2: 3, 3: 3}, {0: 200, 1: 0, 2: 0, 3: 0}, budget=256, min_chunk=8)
    assert caps == {0: 53, 1: 53, 2: 53, 3: 53}  # (203 + 3 * 3) / 4, rounded up
    assert imbalance([203, 3, 3, 3]) == pytest.approx(203 / 53)


def test_nothing_is_cut_when_no_rank_decodes_and_prefill_always_progresses():
    assert rank_caps({0: 0, 1: 0}, {0: 500, 1: 0}, budget=256, min_chunk=8) == {0: 256, 1: 256}
    # a rank with many decodes sets the level; another rank's prefill still gets min_chunk
    caps = rank_caps({0: 40, 1: 0}, {0: 0, 1: 10}, budget=256, min_chunk=8)
    assert caps == {0: 40, 1: 40}
    assert rank_caps({0: 1, 1: 1}, {0: 0, 1: 100}, budget=256, min_chunk=64)[1] == 65
    # decode tokens are never cut, even above the budget
    assert rank_caps({0: 300}, {0: 0}, budget=256, min_chunk=8) == {0: 300}


def test_decode_balance_moves_after_the_same_rank_stays_busiest():
    balance = DecodeBalance(patience=3)
    counts = {0: 5, 1: 2, 2: 3}
    assert [balance.observe(counts, {0, 1, 2}) for _ in range(3)] == [None, None, (0, 1)]
    # a gap of one is even enough; a rank without room takes nothing
    assert balance.observe({0: 3, 1: 2}, {0, 1}) is None
    assert [balance.observe(counts, {0, 2}) for _ in range(3)] == [None, None, (0, 2)]
    # the busiest changing restarts the count
    balance.observe({0: 4, 1: 1}, {1})
    assert balance.observe({0: 1, 1: 4}, {0}) is None


def test_align_rule_refuses_unknown_modes():
    with pytest.raises(ValueError, match="migrate"):
        AlignRule(migrate="teleport")


def decode_all(s: Scheduler, steps: int) -> None:
    for _ in range(steps):
        run_step(s)


def test_scheduler_cuts_a_prefill_to_the_level_and_runs_decodes_first():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=256, align=AlignRule(min_chunk=8, migrate="off"))
    s.set_ranks([0, 1])
    for i in range(4):
        s.add(seq(i, 4, max_tokens=50))
    decode_all(s, 2)  # 2 sequences decoding per rank
    s.add(seq(9, 100, max_tokens=50))
    batch = s.schedule()
    tokens = batch.tokens_per_rank()
    assert batch.unaligned == {0: 102, 1: 2} and sorted(tokens.values()) == [2, 52]
    busy = next(r for r, n in tokens.items() if n == 52)
    # the decodes are rows of the rank's DecodeRows, the prefill a chunk of 50
    assert [n for _, _, n, _ in batch.runs(busy)] == [50, 1, 1] and len(batch.decodes[busy].seq_ids) == 2


def test_an_unstarted_prefill_leaves_a_draining_rank():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, align=AlignRule(min_chunk=4, migrate="off"))
    s.set_ranks([0, 1])
    s.add(seq(0, 40))
    s.add(seq(1, 39))
    run_step(s)
    # placed behind a prefill that takes the whole step of its rank (a prompt of its own: no prefix to wait for)
    s.add(prompt_seq(2, list(range(300, 340))))
    batch, _ = run_step(s)
    first = s.by_id[2].rank
    assert 2 not in {c.seq_id for c in batch.chunks[first]}
    s.drain([first])
    batch = s.schedule()
    assert s.by_id[2].rank == 1 - first and 2 in batch.free[first]  # its old rank drops any row a failed step gave


def uneven(mode: str, patience: int) -> Scheduler:
    """Two ranks: rank 0 holds the two long sequences, rank 1 two that finish after 2 tokens."""
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=256, align=AlignRule(min_chunk=4, migrate=mode,
                                                                              patience=patience))
    s.set_ranks([0, 1])
    for i, (prompt, out) in enumerate([(10, 40), (9, 2), (8, 2), (7, 40)]):  # placed 0, 1, 1, 0
        s.add(seq(i, prompt, max_tokens=out))
    decode_all(s, 2)
    assert [len(s.running[r]) for r in (0, 1)] == [2, 0]
    return s


@pytest.mark.parametrize("mode", ["kv", "reprefill"])
def test_a_decoding_sequence_moves_off_the_rank_that_stays_busiest(mode):
    s = uneven(mode, patience=2)
    first, _ = run_step(s)
    assert not first.moves and not first.reprefilled
    batch, _ = run_step(s)
    if mode == "kv":
        (move,) = batch.moves
        moved = s.by_id[move.seq_id]
        assert (move.src_rank, move.dst_rank) == (0, 1) and move.token_ids == moved.tokens[:len(move.token_ids)]
        assert [c.seq_id for c in batch.chunks[1]] == [move.seq_id]  # it decodes there this step
        # into blocks of its own there, which its chunk's table names
        assert batch.chunks[1][0].block_ids == move.dst_block_ids == s.pools[1].tables[move.seq_id]
        assert move.seq_id not in s.pools[0]  # the source's blocks are freed at commit
        assert moved.rank == 1 and move.seq_id in s.to_free[0]  # re-homed at commit, its old copy freed next
    else:
        (seq_id,) = batch.reprefilled
        moved = s.by_id[seq_id]
        (chunk,) = batch.chunks[1]
        assert moved.rank == 1 and seq_id in batch.free[0]
        assert chunk.start_pos == 0 and chunk.token_ids == moved.tokens[:len(chunk.token_ids)]


def test_a_kv_move_in_a_failed_step_leaves_the_sequence_where_it_was():
    s = uneven("kv", patience=1)
    batch = s.schedule()  # the step fails: nothing is committed
    (move,) = batch.moves
    assert s.by_id[move.seq_id].rank == 0 and len(s.running[0]) == 2
    s.step_failed(batch)
    assert move.seq_id not in s.pools[1] and move.seq_id in s.pools[0]  # the copy's blocks go back
