"""Compact decode plans on the controller's side: a decode goes as a row of its rank's
`DecodeRows` only while the rank is known to keep the sequence (its chunk ran there in a step
that committed, with every step planned since committed, in the same epoch); otherwise, and after
any doubt, the full `ChunkPlan` goes again. Checked against real ranks' state (runtime/held.py)
fed every plan through the codec, through failed steps, epoch changes, preemptions and KV moves."""

from __future__ import annotations

import random

from test_scheduler import prompt_seq, run_step, seq

from elastic_ep.control.serving.alignment import AlignRule
from elastic_ep.control.serving.sampled import Sampled
from elastic_ep.control.serving.scheduler import Scheduler
from elastic_ep.model.kv_cache import KVCache, KVShape
from elastic_ep.runtime.held import HeldSequences
from elastic_ep.wire import CONTROLLER_TO_WORKER, ClusterKey, Inbox, StepPlan


def decoding(s: Scheduler, steps: int = 2) -> None:
    for _ in range(steps):
        run_step(s)


def test_a_decode_goes_as_a_row_with_only_the_block_it_grew_by():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    s.set_ranks([0])
    s.add(seq(1, 7, max_tokens=10))
    first, _ = run_step(s)
    assert [c.seq_id for c in first.chunks[0]] == [1] and not first.decodes
    batch, _ = run_step(s)  # position 7: the last of its second block
    rows = batch.decodes[0]
    assert (rows.seq_ids, rows.tokens, rows.positions, rows.new_blocks) == ([1], [5], [7], [])
    assert not batch.chunks[0] and batch.tokens_per_rank() == {0: 1}
    batch, _ = run_step(s)  # position 8 opens a third block: only its id goes
    assert batch.decodes[0].new_blocks == [(1, s.pools[0].tables[1][2])]
    batch, _ = run_step(s)
    assert batch.decodes[0].new_blocks == []


def test_a_new_epoch_a_failed_step_and_an_uncommitted_plan_send_the_full_chunk_again():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    s.set_ranks([0])
    s.add(seq(1, 7, max_tokens=20))
    decoding(s)
    s.forget_kept()  # what the step loop does when the epoch changes
    batch, _ = run_step(s)
    (chunk,) = batch.chunks[0]
    assert chunk.block_ids == s.pools[0].tables[1] and chunk.params == s.by_id[1].request.params
    assert 0 in s.schedule().decodes  # planned, never committed (the step failed or was interrupted) ...
    s.step_failed(s.schedule())  # ... so this one is full again, and its failure ...
    batch, _ = run_step(s)
    assert [c.seq_id for c in batch.chunks[0]] == [1] and not batch.decodes  # ... makes the next full too
    batch, _ = run_step(s)
    assert batch.decodes[0].seq_ids == [1]


def test_a_sequence_off_its_rank_and_back_is_sent_whole():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=6, block_size=4)
    s.set_ranks([0])
    for i in range(3):
        s.add(prompt_seq(i, list(range(10 * i + 1, 10 * i + 9)), max_tokens=20))
    run_step(s)
    batch, _ = run_step(s)  # 0's next token needs a block: 2 is preempted
    assert batch.preempted == 1 and s.by_id[2].kept is None
    s.abort(0)  # its blocks free: 2 is placed again
    batch, _ = run_step(s)
    assert s.by_id[2].rank == 0 and 2 in {c.seq_id for c in batch.chunks[0]}  # its whole history in a chunk
    assert 2 not in batch.seq_ids_on(0)[len(batch.chunks[0]):]


class Rank:
    """A rank's plan state and KV table as the worker keeps them (runtime/worker.py)."""

    def __init__(self, rank_id: int, num_blocks: int, block_size: int):
        self.rank_id = rank_id
        self.held = HeldSequences()
        self.kv = KVCache(1, KVShape(1, 2, 2), num_blocks, block_size)

    def take(self, plan: StepPlan) -> None:
        held, kv = self.held, self.kv
        held.start(plan)
        held.free(kv, plan.free)
        for move in plan.kv_moves:  # what runtime/kv_move.py leaves on the destination
            if move.dst_rank == self.rank_id:
                kv.set_blocks(move.seq_id, move.dst_block_ids, num_cached=0)
                held.tokens[move.seq_id] = list(move.token_ids)
        held.moved_in(plan.kv_moves, self.rank_id)
        held.runs(plan)
        held.allocate(kv, plan)


def test_ranks_fed_compact_plans_hold_what_the_scheduler_holds_through_faults_epochs_and_moves():
    rng = random.Random(5)
    key = ClusterKey.generate()
    inbox = Inbox("worker_step", CONTROLLER_TO_WORKER, key)
    s = Scheduler(max_num_seqs=6, max_num_batched_tokens=32, block_size=4, num_blocks=40,
                  align=AlignRule(min_chunk=4, migrate="kv", patience=2))
    ranks = {r: Rank(r, 40, 4) for r in (0, 1, 2)}
    s.set_ranks(list(ranks))
    epoch, next_id, rows_sent, chunks_sent, moves, failed = 1, 0, 0, 0, 0, 0
    for step in range(200):
        while len(s.by_id) < 14:
            s.add(prompt_seq(next_id, [rng.randrange(1, 500) for _ in range(rng.randrange(3, 30))],
                             max_tokens=rng.randrange(2, 40)))
            next_id += 1
        if rng.random() < 0.05:
            epoch += 1
            s.forget_kept()
        if rng.random() < 0.05 and s.by_id:
            s.abort(rng.choice(sorted(s.by_id)))
        batch = s.schedule()
        failing = rng.random() < 0.1
        moves += len(batch.moves)
        for r, rank in ranks.items():
            plan = StepPlan(epoch, step, batch.chunks.get(r, []), batch.free.get(r, []), kv_moves=batch.moves,
                            decode=batch.decodes.get(r))
            if failing and rng.random() < 0.5:
                continue  # this rank never got to the plan (or failed before it took it)
            rank.take(inbox.read(key.seal(plan)))
            rows_sent += len(plan.decode.seq_ids) if plan.decode else 0
            chunks_sent += len(plan.chunks)
        if failing:
            s.step_failed(batch)  # some ranks ran it, some not: nothing is committed
            failed += 1
            continue
        sampled = {q: rng.randrange(1, 500) for r in batch.chunks for q, _, _, sample in batch.runs(r) if sample}
        s.commit(batch, Sampled.unranked(sampled))
        for r, rank in ranks.items():
            for q in batch.seq_ids_on(r):
                sq = s.by_id.get(q)
                if sq is None or sq.rank != r:
                    continue
                assert rank.kv.block_table(q) == s.pools[r].tables[q], (step, q)
                assert rank.held.tokens[q] == sq.tokens[:sq.num_cached], (step, q)
                assert rank.held.kept[q].seed == sq.request.seed
                assert rank.held.kept[q].prompt_len == len(sq.request.prompt_token_ids)
    assert rows_sent > 2 * chunks_sent and moves and failed  # mostly rows, sequences moved, steps failed
