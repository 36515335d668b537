"""Steady ranks (control/serving/scheduler.py, `_Steady`): a rank whose sequences of the last
committed step all decode again is planned from that step's rows, without a look at each
sequence, and the step is the one planning each sequence gives; its rows are committed as
columns (the rows' tokens a slice of the rank's answer where it came in the order planned: sampled.py),
and the step's outputs are those of committing row by row. Checked step by step against
a scheduler that plans every sequence and commits row by row, over a random workload with
requests arriving every few steps, ends by EOS and length, aborts (between steps and while a step
runs), failed steps, held sequences, preemptions for blocks and DP moves, every plan read by ranks
that keep what they were told (runtime/held.py)."""

from __future__ import annotations

import random

import numpy as np
from test_compact_plans import Rank
from test_scheduler import EOS, prompt_seq

from elastic_ep.control.serving import scheduler as scheduler_module
from elastic_ep.control.serving.alignment import AlignRule
from elastic_ep.control.serving.sampled import Sampled
from elastic_ep.control.serving.scheduler import Scheduler, StepBatch
from elastic_ep.runtime.held import HeldSequences
from elastic_ep.wire import CONTROLLER_TO_WORKER, ClusterKey, Inbox, StepPlan, StepResult


def planner(num_blocks: int) -> Scheduler:
    s = Scheduler(max_num_seqs=6, max_num_batched_tokens=24, block_size=4, num_blocks=num_blocks,
                  align=AlignRule(min_chunk=4, migrate="kv", patience=3))
    s.set_ranks([0, 1, 2])
    return s


def sampled_of(batch: StepBatch) -> dict[int, int]:
    """A token per sampling sequence, a pure function of it and its position; EOS now and then."""
    return {q: (EOS if (q * 31 + p) % 47 == 0 else 100 + (q * 7 + p) % 300)
            for r in batch.chunks for q, p, n, sample in batch.runs(r) if sample for p in (p + n,)}


def answer(rank_id: int, plan: StepPlan, sampled: dict[int, int]) -> StepResult:
    rows = plan.decode
    tokens = {q: sampled[q] for q in ([c.seq_id for c in plan.chunks if c.sample] + (rows.seq_ids if rows else []))}
    return StepResult(plan.epoch, plan.step, rank_id, tokens, 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {})


def answered(answers: dict[int, StepResult | None], rng: random.Random | None = None) -> Sampled:
    """The step's tokens as the step loop keeps them (serving/sampled.py): each rank's answer in the
    order it ran its rows; with `rng`, a rank's answer now and then in another order (a row's token
    then looked up, as when a rank's answer lacks one)."""
    sampled = Sampled()
    for r, res in answers.items():
        seq_ids = list(res.tokens) if res is not None else []
        if rng is not None and rng.random() < 0.1:
            rng.shuffle(seq_ids)
        sampled.add(r, seq_ids, [res.tokens[q] for q in seq_ids])
    return sampled


def outputs_of(out: list, columns: list) -> dict[int, tuple]:
    """seq_id -> (new tokens, finish reason, logprobs) of a commit's outputs, its columns' rows too."""
    by_seq = {q: (tokens, reason, lps) for q, tokens, reason, lps in out}
    for _, seq_ids, tokens in columns:
        assert not by_seq.keys() & set(seq_ids)
        by_seq.update((q, ([t], None, None)) for q, t in zip(seq_ids, tokens, strict=True))
    return by_seq


def test_a_steady_rank_is_planned_as_planning_each_sequence_plans_it(monkeypatch):
    steady_plans = []
    rows_of = scheduler_module._steady_rows

    def counted(*args):
        rows = rows_of(*args)
        steady_plans.append(rows is not None)
        return rows

    # per rank of a commit from the ranks' answers: whether its decode rows' tokens were looked up
    # (not a slice); the reference's commits, of unranked tokens, are left out
    looked_up, row_tokens_of, lookup_of, looking = [], Sampled.row_tokens, Sampled.lookup, [False]

    def row_tokens_counted(self, *args):
        looking[0] = False
        found = row_tokens_of(self, *args)
        if self._unranked is None:
            looked_up.append(looking[0])
        return found

    def lookup_counted(self, rank):
        looking[0] = True
        return lookup_of(self, rank)

    monkeypatch.setattr(scheduler_module, "_steady_rows", counted)
    monkeypatch.setattr(Sampled, "row_tokens", row_tokens_counted)
    monkeypatch.setattr(Sampled, "lookup", lookup_counted)
    rng = random.Random(5)
    key = ClusterKey.generate()
    inbox = Inbox("worker_step", CONTROLLER_TO_WORKER, key)
    fast, each = planner(24), planner(24)  # a small pool: decodes preempt for blocks
    ranks = {r: Rank(r, 24, 4) for r in (0, 1, 2)}
    last: dict[int, StepResult | None] = dict.fromkeys(ranks)
    next_id, failed, preempted, moves, aborted_in_step, column_rows, column_ends = 0, 0, 0, 0, 0, 0, 0
    for step in range(500):
        if rng.random() < 0.5:
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(2, 14))]
            max_tokens = rng.randrange(2, 80)
            for s in (fast, each):
                s.add(prompt_seq(next_id, prompt, max_tokens=max_tokens))
            next_id += 1
        if rng.random() < 0.02 and each.by_id:
            victim = rng.choice(sorted(each.by_id))
            for s in (fast, each):
                s.abort(victim)
        if rng.random() < 0.02 and each.by_id:
            held = {rng.choice(sorted(each.by_id))} if not each.held else set()
            for s in (fast, each):
                s.hold(held)
        each._steady = {}  # the reference: every sequence looked at, as before steady ranks
        batch = fast.schedule()
        assert batch == each.schedule(), step
        preempted, moves = preempted + batch.preempted, moves + len(batch.moves)
        sampled = sampled_of(batch)
        for r, rank in ranks.items():
            plan = inbox.read(key.seal(StepPlan(1, step, batch.chunks.get(r, []), batch.free.get(r, []),
                                                kv_moves=batch.moves, decode=batch.decodes.get(r))))
            HeldSequences.fill_sampled(plan, last[r])
            rank.take(plan)
            last[r] = answer(r, plan, sampled)
        if rng.random() < 0.03:
            for s in (fast, each):
                s.step_failed(batch)
            last, failed = dict.fromkeys(ranks), failed + 1
            continue
        if rng.random() < 0.05 and batch.columns:  # a sequence of a steady rank aborted while its step runs
            victim = rng.choice(sorted(q.seq_id for column in batch.columns.values() for q in column.seqs))
            for s in (fast, each):
                s.abort(victim)
            aborted_in_step += 1
        columns: list = []
        committed = outputs_of(fast.commit(batch, answered(last, rng), columns=columns), columns)
        assert committed == outputs_of(each.commit(batch, Sampled.unranked(sampled)), [])
        column_rows += sum(len(ids) for _, ids, _ in columns)
        in_columns = {q.seq_id for r, _, _ in columns for q in batch.columns[r].seqs}
        column_ends += sum(committed[q][1] is not None for q in in_columns)
        for r, rank in ranks.items():
            for q in batch.seq_ids_on(r):
                sq = fast.by_id.get(q)
                if sq is not None and sq.rank == r:
                    assert rank.held.tokens[q] == sq.tokens[:sq.num_cached], (step, q)
    assert {q: s.output for q, s in fast.by_id.items()} == {q: s.output for q, s in each.by_id.items()}
    # the workload reached every case: steady ranks planned from their rows and committed as columns
    # (some of a column ending in its step), preemptions, moves, failures, aborts while a step ran
    assert steady_plans.count(True) > 300 and preempted > 5 and moves > 0 and failed > 5
    assert column_rows > 1000 and column_ends > 20 and aborted_in_step > 5
    # a rank's decode rows' tokens a slice of its answer, looked up where the answer came in another order
    assert looked_up.count(False) > 300 and looked_up.count(True) > 20
