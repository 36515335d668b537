"""Steps sent ahead (serve --send-ahead-steps) on the scheduler's side: the step prepared while one
runs is sent before that one commits, so it still has the rows of the requests that end in it (the
ranks compute them once more; the commit drops their tokens) and their blocks are freed in the step
after. Over a random workload with arrivals, aborts at any point, failed steps (the step sent ahead
given up with it) and sampling errors, every request's output and the outputs handed to the streams
are those of planning each step after the last committed, and the ranks (runtime/held.py, fed every
plan through the codec, filling in `SAMPLED_TOKEN` themselves) hold what the scheduler committed."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_compact_plans import Rank
from test_scheduler import EOS, prompt_seq
from test_steady_ranks import answered, outputs_of

from elastic_ep.control.serving.alignment import AlignRule
from elastic_ep.control.serving.scheduler import Scheduler, Sequence, StepBatch
from elastic_ep.runtime.held import HeldSequences
from elastic_ep.wire import CONTROLLER_TO_WORKER, SAMPLED_TOKEN, ClusterKey, DecodeRows, Inbox, StepPlan, StepResult

RANKS = (0, 1, 2)


def token_at(seq_id: int, position: int) -> int | None:
    """A token is a pure function of the sequence and the position it is sampled at; EOS now and then,
    and now and then none (its sampling fails: None)."""
    if (seq_id * 13 + position) % 89 == 0:
        return None
    return EOS if (seq_id * 31 + position) % 50 == 0 else 100 + (seq_id * 7 + position) % 300


class Ranks:
    """The workload's ranks: each runs the plans it is sent in order, as a worker reads its socket, and
    answers with the tokens of `token_at` (a sampling error where it gives none)."""

    def __init__(self, key: ClusterKey):
        self.key, self.inbox = key, Inbox("worker_step", CONTROLLER_TO_WORKER, key)
        self.ranks = {r: Rank(r, 80, 4) for r in RANKS}
        self.last: dict[int, StepResult | None] = dict.fromkeys(RANKS)

    def run(self, batch: StepBatch, step: int, fails: bool) -> dict[int, StepResult | None]:
        """Every rank runs `batch` as step `step`; each one's answer (None: the step failed there)."""
        for r, rank in self.ranks.items():
            plan = self.inbox.read(self.key.seal(StepPlan(1, step, batch.chunks.get(r, []), batch.free.get(r, []),
                                                          kv_moves=batch.moves, decode=batch.decodes.get(r))))
            try:
                not_run = HeldSequences.fill_sampled(plan, self.last[r])
            except RuntimeError:  # a token of a step that failed here: this one fails too (LOCAL)
                self.last[r] = None
                continue
            rank.take(plan)
            runs = [(c.seq_id, c.start_pos + len(c.token_ids)) for c in plan.chunks if c.sample]
            if plan.decode is not None:
                runs += [(q, p + 1) for q, p in zip(plan.decode.seq_ids, plan.decode.positions, strict=True)]
            tokens = {q: t for q, p in runs if (t := token_at(q, p)) is not None}
            errors = {**not_run, **{q: "sampling failed" for q, p in runs if token_at(q, p) is None}}
            self.last[r] = None if fails else StepResult(1, step, r, tokens, 0.0, 0.0, 0.0, 0.0,
                                                         np.zeros((0, 0), np.int32), 0, {}, errors)
        return dict(self.last)


def expected(q: Sequence) -> tuple[list[int], str]:
    """A request's output by definition, and how it ends: token i is `token_at` its prompt's length + i,
    until EOS (stop), a sampling error (error) or its max_tokens (length)."""
    out = []
    while len(out) < q.request.params.max_tokens:
        token = token_at(q.seq_id, q.prompt_len + len(out))
        if token is None:
            return out, "error"
        out.append(token)
        if token == EOS:
            return out, "stop"
    return out, "length"


def run_workload(ahead_steps: int, seed: int = 7) -> tuple[dict[int, Sequence], set[int], dict[int, list],
                                                              dict[str, int]]:
    """A random workload on 3 ranks, each step committed when its answers are in; with `ahead_steps`,
    up to that many steps in a row prepared and sent before the step before them commits. Returns the
    requests, those aborted, every output handed to the streams per request in order, and counts."""
    rng = random.Random(seed)
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=80,
                  align=AlignRule(min_chunk=4, migrate="kv", patience=3))
    s.set_ranks(list(RANKS))
    ranks = Ranks(ClusterKey.generate())
    requests, aborted, delivered = {}, set(), {}
    counts = {"ahead": 0, "junk_rows": 0, "given_up": 0, "not_run": 0}
    in_flight: list[tuple[StepBatch, int, dict]] = []  # sent, not committed: (batch, step, answers)
    step, next_id, left_ahead = 0, 0, 0

    def abort_one() -> None:
        if s.by_id:
            q = rng.choice(sorted(s.by_id))
            s.abort(q)
            aborted.add(q)

    for tick in range(600):
        if tick % 50 == 0:  # a burst of requests, then they decode until they end
            for _ in range(rng.randrange(6, 12)):
                own = random.Random(seed * 1000 + next_id)  # the same request whatever ran before it
                q = prompt_seq(next_id, [own.randrange(1, 500) for _ in range(own.randrange(3, 12))],
                               max_tokens=own.randrange(3, 60))
                s.add(q)
                requests[next_id] = q
                next_id += 1
        if rng.random() < 0.01:  # an abort at any point, a step in flight or not
            abort_one()
        if not in_flight:
            if not s.has_work:
                continue
            step += 1
            batch, left_ahead = s.schedule(), ahead_steps
            in_flight.append((batch, step, ranks.run(batch, step, fails=rng.random() < 0.03)))
        batch, _, answers = in_flight[0]
        if ahead_steps and left_ahead and len(in_flight) == 1 and s.prepare_decodes(batch) is not None:
            taken = s.take_prepared(ahead=True)
            if taken is not None:
                left_ahead -= 1
                step += 1
                counts["ahead"] += 1
                nxt = taken[0]
                in_flight.append((nxt, step, ranks.run(nxt, step, fails=rng.random() < 0.03)))
        if rng.random() < 0.01:  # aborted while the step runs
            abort_one()
        in_flight.pop(0)
        if any(a is None for a in answers.values()):  # the step failed: the one sent ahead is given up
            s.step_failed(batch)
            for given_up, _, _ in in_flight:
                s.step_failed(given_up)
                counts["given_up"] += 1
            in_flight.clear()
            continue
        for res in answers.values():  # as the step loop's commit: a request whose sampling failed ends
            for q, error in res.errors.items():
                counts["not_run"] += error.startswith("no token to run")
                if q in s.by_id:
                    s.abort(q)
                    s_q = requests[q]
                    s_q.finish_reason = "error"
                    delivered.setdefault(q, []).append(([], "error", None))
        counts["junk_rows"] += sum(q not in s.by_id for rows in batch.decodes.values() for q in rows.seq_ids)
        columns: list = []
        for q, out in outputs_of(s.commit(batch, answered(answers), columns=columns), columns).items():
            delivered.setdefault(q, []).append(out)
        for r, rank in ranks.ranks.items():  # a rank holds what was committed (and what it ran ahead after it)
            for q in batch.seq_ids_on(r):
                sq = s.by_id.get(q)
                if sq is not None and sq.rank == r and q in rank.held.tokens:
                    assert rank.held.tokens[q][:sq.num_cached] == sq.tokens[:sq.num_cached], (tick, q)
    return requests, aborted, delivered, counts


@pytest.mark.parametrize("ahead_steps", [0, 4])
def test_every_request_gets_its_output_with_or_without_steps_sent_ahead(ahead_steps):
    requests, aborted, delivered, counts = run_workload(ahead_steps)
    ended = {"stop": 0, "length": 0, "error": 0}
    for q, seq in requests.items():
        want, reason = expected(seq)
        streamed = [t for toks, _, _ in delivered.get(q, []) for t in toks]
        assert streamed == seq.output, q  # what the streams got, in order, is the output
        if q in aborted and seq.finish_reason == "abort":
            assert seq.output == want[:len(seq.output)], q
            continue
        assert (seq.output, seq.finish_reason) == (want, reason), q
        ended[reason] += 1
    assert all(n > 2 for n in ended.values()) and len(aborted) > 2
    if ahead_steps:
        # what sending ahead meets: requests that ended computed once more (rows whose request left the
        # rank: without it only those aborted while their step ran), steps given up with the failed one
        # before them, a row a rank took out (its sampling had failed in the step before)
        assert counts["ahead"] > 150 and counts["given_up"] > 2 and counts["not_run"] > 0
        assert counts["junk_rows"] > run_workload(0)[3]["junk_rows"] + 20
    else:
        assert counts["ahead"] == counts["given_up"] == counts["not_run"] == 0


def test_a_step_sent_ahead_keeps_the_rows_of_requests_that_end_and_the_next_one_frees_them():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    s.set_ranks([0])
    for q in (1, 2):
        s.add(prompt_seq(q, [q, q + 10, q + 20], max_tokens=30))
    batch = s.schedule()
    s.commit(batch, answered({0: StepResult(1, 1, 0, {1: 101, 2: 102}, 0.0, 0.0, 0.0, 0.0,
                                            np.zeros((0, 0), np.int32), 0, {})}))
    b1 = s.schedule()  # both decode
    assert s.prepare_decodes(b1) is not None
    b2, _ = s.take_prepared(ahead=True)  # sent before b1 commits
    assert b2.decodes[0].seq_ids == [1, 2] and b2.decodes[0].tokens == [SAMPLED_TOKEN] * 2
    s.commit(b1, answered({0: StepResult(1, 2, 0, {1: EOS, 2: 103}, 0.0, 0.0, 0.0, 0.0,
                                         np.zeros((0, 0), np.int32), 0, {})}))  # sequence 1 ends
    assert 1 not in s.by_id and s.to_free[0] == [1]
    b3 = s.prepare_decodes(b2)  # while b2 (with sequence 1's row) runs
    assert b3 is not None and b3.decodes[0].seq_ids == [2]
    taken, changed = s.take_prepared(ahead=True)
    assert taken is b3 and changed and b3.free[0] == [1] and s.to_free[0] == []
    out = s.commit(b2, answered({0: StepResult(1, 3, 0, {1: 55, 2: 104}, 0.0, 0.0, 0.0, 0.0,
                                               np.zeros((0, 0), np.int32), 0, {})}))
    assert [(q, toks) for q, toks, _, _ in out] == [(2, [104])]  # sequence 1's token dropped
    assert s.by_id[2].output == [102, 103, 104]


def test_a_rank_takes_out_a_row_whose_sampling_failed_in_the_step_before():
    plan = StepPlan(1, 8, [], [], decode=DecodeRows([3, 4, 5], [SAMPLED_TOKEN] * 3, [10, 6, 7], [(4, 9), (5, 11)]))
    before = StepResult(1, 7, 0, {3: 42, 5: 43}, 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {},
                        {4: "sampling failed: ValueError"})
    not_run = HeldSequences.fill_sampled(plan, before)
    assert list(not_run) == [4] and "sampling it failed in step 7" in not_run[4]
    rows = plan.decode
    assert (rows.seq_ids, rows.tokens, rows.positions, rows.new_blocks) == ([3, 5], [42, 43], [10, 7], [(5, 11)])
