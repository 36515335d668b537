"""Overlap scheduling on the scheduler's side (serve --async-scheduling): the step prepared while
the one before runs is the step `schedule` would have planned, or it is not taken: a sequence
that finished (EOS, its length) or was aborted meanwhile is taken out of it (its KV freed in it),
and it is dropped when a request arrives, the step fails, or anything else changes what the next
step may run. Checked against real ranks' state (runtime/held.py), which fill in the sampled
tokens themselves, over a random workload with failures and aborts."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from test_compact_plans import Rank
from test_scheduler import EOS, prompt_seq, seq
from test_steady_ranks import answered, outputs_of

from elastic_ep.control.serving.alignment import AlignRule
from elastic_ep.control.serving.sampled import Sampled
from elastic_ep.control.serving.scheduler import Scheduler, StepBatch
from elastic_ep.runtime.held import HeldSequences
from elastic_ep.wire import CONTROLLER_TO_WORKER, SAMPLED_TOKEN, ClusterKey, DecodeRows, Inbox, StepPlan, StepResult


def sampled_of(batch: StepBatch, token: int = 5) -> dict[int, int]:
    return {q: token for r in batch.chunks for q, _, _, sample in batch.runs(r) if sample}


def decoding_pair(max_tokens: int = 30, max_tokens_2: int | None = None) -> tuple[Scheduler, StepBatch]:
    """Two sequences on one rank, decoding; returns the scheduler and the batch just planned (their
    third tokens)."""
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    s.set_ranks([0])
    s.add(seq(1, 6, max_tokens=max_tokens))
    s.add(seq(2, 3, max_tokens=max_tokens_2 or max_tokens))
    for _ in range(2):
        batch = s.schedule()
        s.commit(batch, Sampled.unranked(sampled_of(batch)))
    return s, s.schedule()


def test_the_prepared_step_is_the_one_schedule_plans():
    s, batch = decoding_pair()
    nxt = s.prepare_decodes(batch)
    assert nxt is not None and nxt.decodes[0].tokens == [SAMPLED_TOKEN, SAMPLED_TOKEN]
    s.commit(batch, Sampled.unranked({1: 11, 2: 12}))
    planned = copy.deepcopy(s).schedule()  # what the step would have been without the preparation
    taken, changed = s.take_prepared()
    assert taken is nxt and not changed
    want, got = planned.decodes[0], taken.decodes[0]
    assert (got.seq_ids, got.positions, got.new_blocks) == (want.seq_ids, want.positions, want.new_blocks)
    assert want.tokens == [11, 12]  # the tokens the rank sampled, which it fills in
    assert got.new_blocks  # sequence 1 crosses into a third block: grown as `schedule` grows it
    s.commit(taken, Sampled.unranked({1: 13, 2: 14}))
    assert s.by_id[1].output[-2:] == [11, 13] and s.by_id[2].output[-2:] == [12, 14]


@pytest.mark.parametrize("end", ["eos", "abort", "length"])
def test_a_sequence_that_ends_meanwhile_is_taken_out_of_the_prepared_step_and_freed_in_it(end):
    s, batch = decoding_pair(max_tokens_2=3 if end == "length" else None)  # length: its 3rd token ends it
    nxt = s.prepare_decodes(batch)
    assert nxt.decodes[0].seq_ids == ([1] if end == "length" else [1, 2])
    if end == "abort":
        s.abort(2)
    s.commit(batch, Sampled.unranked({1: 11, 2: EOS if end == "eos" else 12}))
    planned = copy.deepcopy(s).schedule()
    taken, changed = s.take_prepared()
    assert changed and taken.free[0] == planned.free[0] == [2]
    want, got = planned.decodes[0], taken.decodes[0]
    assert (got.seq_ids, got.positions, got.new_blocks) == (want.seq_ids, want.positions, want.new_blocks) == (
        [1], [8], want.new_blocks) and want.new_blocks
    assert taken.tokens_per_rank() == {0: 1} and s.to_free[0] == []


@pytest.mark.parametrize("change", ["new_request", "failed", "hold", "length", "all_end"])
def test_a_change_drops_the_prepared_step(change):
    s, batch = decoding_pair(max_tokens=3 if change == "length" else 30)
    nxt = s.prepare_decodes(batch)
    if change == "length":  # its 3rd and last token is due in this step: its end is known, nothing is prepared
        assert nxt is None
        return
    assert nxt is not None
    sampled = {1: 11, 2: 12}
    if change == "failed":
        s.step_failed(batch)
        assert s.take_prepared() is None
        return
    if change == "all_end":
        sampled = {1: EOS, 2: EOS}
    if change == "new_request":
        s.add(seq(3, 4))
    if change == "hold":
        s.hold({1})
    s.commit(batch, Sampled.unranked(sampled))
    assert s.take_prepared() is None
    batch = s.schedule()
    if change == "all_end":
        assert batch.free[0] == [1, 2]  # their KV is freed in the step planned instead


def test_nothing_is_prepared_while_a_request_waits_or_prefills():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=4, block_size=4)
    s.set_ranks([0])
    s.add(seq(1, 10))
    assert s.prepare_decodes(s.schedule()) is None  # a prefill chunk in the step
    s, batch = decoding_pair()
    s.add(seq(3, 4))
    assert s.prepare_decodes(batch) is None


def answer(rank_id: int, plan: StepPlan, rows: DecodeRows | None, sampled: dict[int, int]) -> StepResult:
    tokens = {q: sampled[q] for q in ([c.seq_id for c in plan.chunks if c.sample] + (rows.seq_ids if rows else []))}
    return StepResult(plan.epoch, plan.step, rank_id, tokens, 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {})


def run_workload(prepare: bool, seed: int = 3) -> tuple[list, dict[int, list[int]], tuple[int, int], list, int, int]:
    """A random workload (requests of random lengths ending by length or EOS, aborts, failed steps)
    on 3 ranks fed every plan through the codec, the ranks filling in `SAMPLED_TOKEN` from their
    last answer; with `prepare` every step is committed with columns. Returns every step's (rank,
    seq_id, position) runs and KV moves, each request's output, how many steps were prepared and
    taken (and of those, how many with sequences that ended taken out), every commit's outputs
    (`outputs_of`), the rows of prepared steps committed as columns, and the prepared ranks whose
    rows were prepared from their column of the step before (its stop tokens and room carried on)."""
    rng = random.Random(seed)
    key = ClusterKey.generate()
    inbox = Inbox("worker_step", CONTROLLER_TO_WORKER, key)
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=60,
                  align=AlignRule(min_chunk=4, migrate="kv", patience=3))
    ranks = {r: Rank(r, 60, 4) for r in (0, 1, 2)}
    last: dict[int, StepResult | None] = dict.fromkeys(ranks)
    s.set_ranks(list(ranks))
    runs, requests, taken, rebuilt, next_id, delivered, prepared_columns, carried = [], {}, 0, 0, 0, [], 0, 0
    for step in range(400):
        if step % 40 == 0:  # a burst of requests, then they decode until they end
            for _ in range(rng.randrange(6, 12)):
                q = prompt_seq(next_id, [rng.randrange(1, 500) for _ in range(rng.randrange(3, 12))],
                               max_tokens=rng.randrange(3, 60))
                s.add(q)
                requests[next_id] = q
                next_id += 1
        if rng.random() < 0.01 and s.by_id:
            s.abort(rng.choice(sorted(s.by_id)))
        prepared = s.take_prepared() if prepare else None
        taken += prepared is not None
        rebuilt += prepared is not None and prepared[1]
        batch = prepared[0] if prepared is not None else s.schedule()
        failing = rng.random() < 0.03
        # a token is a pure function of the sequence and its position; EOS now and then
        sampled = {q: (EOS if (q * 31 + p) % 50 == 0 else 100 + (q * 7 + p) % 300)
                   for r in batch.chunks for q, p, n, sample in batch.runs(r) if sample for p in (p + n,)}
        if rng.random() < 0.01 and s.by_id:  # aborted while the step runs, before the next is prepared
            s.abort(rng.choice(sorted(s.by_id)))
        nxt = s.prepare_decodes(batch) if prepare and not failing else None
        carried += sum(c.stops is not None for c in nxt.columns.values()) if nxt is not None else 0
        for r, rank in ranks.items():
            plan = inbox.read(key.seal(StepPlan(1, step, batch.chunks.get(r, []), batch.free.get(r, []),
                                                kv_moves=batch.moves, decode=batch.decodes.get(r))))
            HeldSequences.fill_sampled(plan, last[r])
            rank.take(plan)
            last[r] = answer(r, plan, plan.decode, sampled)
        # not the block ids: a table grown at preparation takes a free block before the step's ends free theirs
        runs.append(sorted((r, q, p) for r in batch.chunks for q, p, _, _ in batch.runs(r))
                    + [(m.seq_id, m.src_rank, m.dst_rank) for m in batch.moves])
        if failing:
            s.step_failed(batch)
            last = dict.fromkeys(ranks)  # the ranks answered StepFailed
            continue
        assert nxt is None or nxt.seq_ids() <= batch.seq_ids()
        columns: list | None = [] if prepare else None
        delivered.append(outputs_of(s.commit(batch, answered(last), columns=columns), columns or []))
        if prepared is not None:
            prepared_columns += sum(len(ids) for _, ids, _ in columns)
        for r, rank in ranks.items():
            for q in batch.seq_ids_on(r):
                sq = s.by_id.get(q)
                if sq is not None and sq.rank == r:
                    assert rank.held.tokens[q] == sq.tokens[:sq.num_cached], (step, q)
    return runs, {q: seq.output for q, seq in requests.items()}, (taken, rebuilt), delivered, prepared_columns, carried


def test_prepared_steps_run_the_same_steps_and_tokens_as_planning_each_after_the_last():
    runs, outputs, none_taken, delivered, _, _ = run_workload(prepare=False)
    runs_p, outputs_p, (taken, rebuilt), delivered_p, prepared_columns, carried = run_workload(prepare=True)
    assert none_taken == (0, 0) and taken > 100 and rebuilt > 5  # most steps of a decode phase are prepared
    assert runs_p == runs
    assert outputs_p == outputs and any(o and o[-1] == EOS for o in outputs.values())
    # the prepared steps' rows committed as columns give each step's outputs of committing row by row
    assert delivered_p == delivered and prepared_columns > 500
    assert carried > 50  # prepared ranks whose rows came from their column, not a look at each sequence


def test_a_rank_refuses_the_sampled_marker_for_a_sequence_it_did_not_sample_in_the_step_before():
    plan = StepPlan(1, 8, [], [], decode=DecodeRows([3, 4], [SAMPLED_TOKEN, 9], [10, 6]))
    before = StepResult(1, 7, 0, {3: 42}, 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {})
    HeldSequences.fill_sampled(plan, before)
    assert plan.decode.tokens == [42, 9]
    for last in (None, StepResult(1, 6, 0, {3: 42}, 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {}),
                 StepResult(2, 7, 0, {3: 42}, 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {}),
                 StepResult(1, 7, 0, {4: 42}, 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {})):
        plan = StepPlan(1, 8, [], [], decode=DecodeRows([3], [SAMPLED_TOKEN], [10]))
        with pytest.raises(RuntimeError, match=r"sequences \[3\] take the token"):
            HeldSequences.fill_sampled(plan, last)
