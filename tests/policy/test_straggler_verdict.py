"""The straggler verdict on synthetic intervals: a slow rank with the same tokens is named and
only it; a rank with more tokens is a DP imbalance, never a straggler; stale or too few
samples give no verdict; a whole-group slowdown and small absolute excesses accuse nobody."""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import pytest

from elastic_ep.errors import ElasticEPError
from elastic_ep.policy.straggler_verdict import (
    INTERVALS_PER_WINDOW,
    Interval,
    IntervalRecorder,
    RankInterval,
    StragglerRule,
    VerdictKind,
    _columns_of,
    judge,
)

RULE = StragglerRule()


def rows_of(interval: Interval, rule: StragglerRule) -> dict[int, SimpleNamespace]:
    """The interval's columns as one row per rank, None where the rank had no others or no peers."""
    c = _columns_of(interval, rule)
    return {int(r): SimpleNamespace(
        steps=int(c.steps[i]), own_s=c.own_s[i], tokens=c.tokens[i],
        others_ms=c.others_ms[i] if c.others[i] else None, others_tokens=c.others_tokens[i] if c.others[i] else None,
        heavy=bool(c.heavy[i]), peer_ms=c.peer_ms[i] if c.peered[i] else None, over=bool(c.over[i]))
        for i, r in enumerate(c.rank_ids)}


def intervals(per_rank: dict[int, tuple[float, float]], count: int = 10, steps: int = 20, end_s: float = 100.0,
              length_s: float = 0.5) -> list[Interval]:
    """`count` intervals ending at end_s; per rank (own ms per step, tokens per step)."""
    out = []
    for i in range(count):
        stop = end_s - (count - 1 - i) * length_s
        ranks = {r: RankInterval(steps, own_ms * steps / 1000, round(tokens * steps)) for r, (own_ms, tokens)
                 in per_rank.items()}
        out.append(Interval(stop - length_s, stop, ranks))
    return out


def kinds(verdicts) -> dict[int, str]:
    return {r: v.kind.value for r, v in sorted(verdicts.items())}


def test_a_slow_rank_with_the_same_tokens_is_the_only_straggler():
    verdicts = judge(intervals({0: (5.0, 1), 1: (5.2, 1), 2: (55.0, 1), 3: (4.9, 1)}), RULE, 100.0)
    assert kinds(verdicts) == {0: "ok", 1: "ok", 2: "straggler", 3: "ok"}
    v = verdicts[2]
    assert (v.over, v.intervals, v.steps) == (10, 10, 200)
    assert "55.0 ms/step against 5.0 ms on ranks with at least as many tokens" in v.evidence
    assert "200 steps in 10 intervals spanning 5.0s, newest 0.0s old" in v.evidence


def test_one_slowness_ratio_in_the_evidence_and_the_json():
    v = judge(intervals({0: (5.0, 1), 1: (5.2, 1), 2: (55.0, 1), 3: (4.9, 1)}), RULE, 100.0)[2]
    assert v.ratio == pytest.approx(55.0 / 5.0)
    assert v.to_json()["ratio"] == round(v.ratio, 3) and f"({v.ratio:.2f}x)" in v.evidence


def test_a_slow_rank_with_fewer_tokens_is_a_straggler():
    verdicts = judge(intervals({0: (6.0, 1), 1: (6.0, 1), 2: (56.0, 0), 3: (6.0, 1)}), RULE, 100.0)
    assert kinds(verdicts) == {0: "ok", 1: "ok", 2: "straggler", 3: "ok"}


def test_more_tokens_and_more_time_is_dp_imbalance_not_a_straggler():
    # one request at a time: rank 0 holds it, its own time is 1.9x the idle ranks'
    verdicts = judge(intervals({0: (9.4, 1), 1: (5.0, 0), 2: (5.0, 0), 3: (5.0, 0)}), RULE, 100.0)
    assert kinds(verdicts) == {0: "dp-imbalance", 1: "ok", 2: "ok", 3: "ok"}
    assert "runs 1.00 tokens/step against 0.00 on the others" in verdicts[0].evidence
    assert verdicts[0].judged == 0  # nobody ran as many tokens: never compared for slowness


def test_stale_samples_give_no_verdict():
    old = intervals({0: (5.0, 1), 1: (50.0, 1), 2: (5.0, 1)}, end_s=100.0)
    verdicts = judge(old, RULE, now_s=100.0 + RULE.window_s + 1, rank_ids=[0, 1, 2, 3])
    assert kinds(verdicts) == {0: "unknown", 1: "unknown", 2: "unknown", 3: "unknown"}
    assert verdicts[1].evidence == "no verdict: no step in the last 5s (needs 10 steps in 4 intervals)"


def test_too_few_steps_or_intervals_give_no_verdict():
    few = intervals({0: (5.0, 1), 1: (50.0, 1), 2: (5.0, 1)}, count=4, steps=2)
    verdicts = judge(few, RULE, 100.0)
    assert kinds(verdicts) == {0: "unknown", 1: "unknown", 2: "unknown"}
    assert "8 steps in 4 intervals" in verdicts[1].evidence
    brief = intervals({0: (5.0, 1), 1: (50.0, 1), 2: (5.0, 1)}, count=3, steps=50)  # slow for a moment only
    assert kinds(judge(brief, RULE, 100.0)) == {0: "unknown", 1: "unknown", 2: "unknown"}


def test_slowness_must_persist_over_the_window():
    calm = intervals({0: (5.0, 1), 1: (5.0, 1), 2: (5.0, 1)}, count=7, end_s=98.5)
    slow = intervals({0: (5.0, 1), 1: (50.0, 1), 2: (5.0, 1)}, count=3, end_s=100.0)
    assert judge(calm + slow, RULE, 100.0)[1].kind == VerdictKind.OK
    slow = intervals({0: (5.0, 1), 1: (50.0, 1), 2: (5.0, 1)}, count=8, end_s=100.0)
    assert judge(calm[:2] + slow, RULE, 100.0)[1].kind == VerdictKind.STRAGGLER


@pytest.mark.parametrize("per_rank", [
    {0: (50.0, 1), 1: (52.0, 1), 2: (51.0, 1), 3: (50.0, 1)},  # the whole group slow
    {0: (1.0, 1), 1: (2.5, 1), 2: (1.0, 1), 3: (1.0, 1)},  # 2.5x but only 1.5 ms more
])
def test_no_straggler_without_both_a_relative_and_an_absolute_excess(per_rank):
    assert set(kinds(judge(intervals(per_rank), RULE, 100.0)).values()) == {"ok"}


def test_the_recorder_sums_steps_per_interval_and_closes_idle_intervals_on_time():
    rec = IntervalRecorder(window_s=5.0)
    assert rec.interval_s == 5.0 / INTERVALS_PER_WINDOW
    for k in range(10):  # 10 steps over 0.45 s: one interval
        rec.add(k * 0.05, 0, 2, 0.004)
        rec.add(k * 0.05, 1, 0, 0.003)
    assert rec.intervals(0.49) == []
    [closed] = rec.intervals(60.0)  # idle for a minute: the interval still ends at 0.5 s
    assert (closed.start_s, closed.end_s) == (0.0, 0.5)
    assert closed.ranks[0] == RankInterval(10, pytest.approx(0.04), 20)
    assert judge(rec.intervals(60.0), RULE, 60.0, rank_ids=[0])[0].kind == VerdictKind.UNKNOWN


def test_a_rule_that_cannot_work_is_refused():
    with pytest.raises(ElasticEPError, match="--straggler-ratio must be > 1"):
        StragglerRule(ratio=1.0)
    with pytest.raises(ElasticEPError, match=r"--straggler-persistence must be in \(0, 1\]"):
        StragglerRule(persistence=0)


def test_an_intervals_rows_match_the_pairwise_definition_at_many_ranks():
    """The vectorized columns give each rank the medians of the definition, exactly: over every
    other rank, and over its peers (the others that did not run notably fewer tokens), and whether
    it ran heavy or slow against them."""
    rnd = random.Random(7)
    for k in range(200):
        size = rnd.randint(100, 300) if k % 20 == 0 else rnd.randint(1, 40)
        ranks = {r: RankInterval(rnd.choice([0, 1, 4]), rnd.choice([0.004, 0.005, rnd.random() / 20]),
                                 rnd.choice([0, 8, 64, 65, rnd.randint(0, 200)])) for r in range(size)}
        rows = rows_of(Interval(0.0, 1.0, ranks), RULE)
        live = {r: x for r, x in ranks.items() if x.steps > 0}
        assert set(rows) == set(live)
        for r, x in live.items():
            others = [y for p, y in live.items() if p != r]
            row = rows[r]
            if not others:
                assert row.others_ms is None and row.peer_ms is None
                continue
            assert row.others_ms == statistics.median(y.own_ms_per_step for y in others)
            assert row.others_tokens == statistics.median(y.tokens_per_step for y in others)
            peers = [y.own_ms_per_step for y in others if not RULE.more_tokens(x.tokens_per_step, y.tokens_per_step)]
            assert row.peer_ms == (statistics.median(peers) if peers else None)
            assert row.heavy == RULE.more_tokens(x.tokens_per_step, row.others_tokens)
            assert row.over == (bool(peers) and RULE.slow(x.own_ms_per_step, row.peer_ms))


def test_the_verdicts_sum_each_ranks_rows_over_the_fresh_intervals():
    """judge's numpy sums over the intervals' columns are the counts and means of a plain loop over
    the rows, for ranks that come and go between intervals."""
    rnd = random.Random(11)
    for _ in range(50):
        fresh = []
        for k in range(rnd.randint(1, 11)):
            ranks = {r: RankInterval(rnd.choice([0, 2, 5]), rnd.random() / 10,
                                     rnd.choice([0, 8, 64, rnd.randint(0, 99)]))
                     for r in rnd.sample(range(30), rnd.randint(1, 30))}
            fresh.append(Interval(10.0 + k, 11.0 + k, ranks))
        rule = StragglerRule(min_steps=3, min_intervals=1, window_s=20.0)  # every interval fresh
        verdicts = judge(fresh, rule, 22.0)
        for r, v in verdicts.items():
            rows = [rows_of(i, rule)[r] for i in fresh if r in rows_of(i, rule)]
            compared = [x for x in rows if x.others_ms is not None]
            peered = [x for x in compared if x.peer_ms is not None]
            assert (v.steps, v.intervals, v.judged) == (sum(x.steps for x in rows), len(rows), len(peered))
            assert (v.heavy, v.over) == (sum(x.heavy for x in compared), sum(x.over for x in peered))
            assert v.own_ms == pytest.approx(1000 * sum(x.own_s for x in rows) / v.steps)
            assert v.peer_own_ms == (pytest.approx(statistics.mean(x.peer_ms for x in peered)) if peered else None)
            assert v.others_own_ms == (pytest.approx(statistics.mean(x.others_ms for x in compared)) if compared
                                       else None)
            assert v.tokens_per_step == pytest.approx(sum(x.tokens for x in rows) / v.steps)
        assert set(verdicts) == {r for i in fresh for r, x in i.ranks.items() if x.steps > 0}
