"""Bounded per-rank series: at most --metrics-top-k ranks carry a rank label whatever the group's
size, the ranks in trouble first, no stale series, counters that survive leaving the set."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.control.metrics import STEP_BUCKETS, ClusterMetrics
from elastic_ep.control.rank_series import EVICTED_HOLD_S, select_ranks

RANKS = 1024


def scrape(registry: CollectorRegistry) -> dict:
    """{(sample name, frozenset(labels)): value}."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples}


def labelled_ranks(samples: dict) -> set[str]:
    return {dict(labels)["rank"] for _, labels in samples if "rank" in dict(labels)}


def run_steps(metrics: ClusterMetrics, own_s: dict[int, float], steps: int = 3) -> None:
    ranks = sorted(own_s)
    for _ in range(steps):
        own = [own_s[r] for r in ranks]
        metrics.ranks.step(ranks, [o + 0.002 for o in own], [0.002] * len(ranks), own, [4] * len(ranks),
                           [1] * len(ranks), [100] * len(ranks))


def test_flagged_ranks_come_first_then_the_slowest_within_the_bound():
    own = {r: 0.010 for r in range(100)} | {7: 0.050, 8: 0.040}
    chosen = select_ranks(own, {3: "straggler", 90: "down", 5: "stalled"}, top_k=4)
    assert chosen == {90: "down", 5: "stalled", 3: "straggler", 7: "slowest"}
    assert len(select_ranks(own, dict.fromkeys(range(50), "down"), top_k=4)) == 4


def test_an_exported_rank_keeps_its_place_until_a_newcomer_is_clearly_slower():
    own = {0: 0.010, 1: 0.0105, 2: 0.009}
    assert set(select_ranks(own, {}, 1, previous=[0])) == {0}  # 5% slower is noise: no churn
    assert set(select_ranks({**own, 1: 0.013}, {}, 1, previous=[0])) == {1}


def test_1024_ranks_export_at_most_top_k_per_rank_series():
    unbounded, bounded = CollectorRegistry(), CollectorRegistry()
    own = {r: 0.010 + 0.00001 * (r % 7) for r in range(RANKS)} | {613: 0.080}
    for registry, top_k in ((unbounded, RANKS), (bounded, 16)):
        m = ClusterMetrics(registry, "tiny", top_k)
        run_steps(m, own)
        m.ranks.set_gauge("elastic_ep_rank_up", dict.fromkeys(range(RANKS), 1))
        m.ranks.select({5: "stalled"}, range(RANKS), 0.0)
    full, small = scrape(unbounded), scrape(bounded)
    assert len(labelled_ranks(full)) == RANKS
    exported = labelled_ranks(small)
    assert len(exported) == 16 and {"5", "613"} <= exported  # the stalled one and the slowest
    per_rank = [k for k in small if "rank" in dict(k[1])]
    per_rank_series_per_rank = len([k for k in full if "rank" in dict(k[1])]) / RANKS
    assert len(per_rank) <= 16 * per_rank_series_per_rank
    assert len(small) < 0.03 * len(full)
    # the whole group is still in the distributions: one observation per rank per step
    assert small[("elastic_ep_group_own_seconds_count", frozenset())] == 3 * RANKS
    assert small[("elastic_ep_group_step_seconds_bucket", frozenset({("le", "+Inf")}))] == 3 * RANKS
    assert small[("elastic_ep_rank_exported", frozenset({("rank", "5"), ("reason", "stalled")}))] == 1
    assert small[("elastic_ep_metrics_exported_ranks", frozenset())] == 16


def test_a_rank_that_leaves_the_set_has_no_series_and_its_counters_continue_when_it_returns():
    registry = CollectorRegistry()
    m = ClusterMetrics(registry, "tiny", top_k=2)
    own = {r: 0.010 for r in range(8)} | {3: 0.030, 4: 0.020}
    run_steps(m, own)
    m.ranks.select({}, range(8), 0.0)
    assert labelled_ranks(scrape(registry)) == {"3", "4"}
    tokens_before = scrape(registry)[("elastic_ep_rank_tokens_total", frozenset({("rank", "4")}))]
    run_steps(m, own | {4: 0.010, 6: 0.040}, steps=40)  # rank 4 recovers, rank 6 turns slow
    m.ranks.select({}, range(8), 0.0)
    samples = scrape(registry)
    assert labelled_ranks(samples) == {"3", "6"}, "rank 4's series must be gone, not left stale"
    run_steps(m, own | {4: 0.060}, steps=40)
    m.ranks.select({}, range(8), 0.0)
    samples = scrape(registry)
    assert "4" in labelled_ranks(samples)
    assert samples[("elastic_ep_rank_tokens_total", frozenset({("rank", "4")}))] == tokens_before + 80 * 4
    assert samples[("elastic_ep_rank_step_seconds_count", frozenset({("rank", "4")}))] == 83


def test_a_forgotten_rank_leaves_no_series():
    registry = CollectorRegistry()
    m = ClusterMetrics(registry, "tiny", top_k=4)
    run_steps(m, {0: 0.01, 1: 0.02})
    m.ranks.set_gauge("elastic_ep_rank_up", {0: 1, 1: 1})
    m.ranks.select({}, [0, 1], 0.0)
    m.forget_rank(1)
    assert labelled_ranks(scrape(registry)) == {"0"}


def test_histogram_buckets_follow_prometheus_le():
    registry = CollectorRegistry()
    m = ClusterMetrics(registry, "tiny", top_k=1)
    m.ranks.step([0], [STEP_BUCKETS[2]], [0.0], [0.0], [1], [0], [0])
    m.ranks.select({}, [0], 0.0)
    samples = scrape(registry)
    le = {float(dict(k[1])["le"]): v for k, v in samples.items()
          if k[0] == "elastic_ep_rank_step_seconds_bucket"}
    assert le[STEP_BUCKETS[1]] == 0 and le[STEP_BUCKETS[2]] == 1 and le[np.inf] == 1


def test_an_evicted_rank_keeps_its_series_marked_until_the_hold_ends_or_its_id_returns():
    registry = CollectorRegistry()
    m = ClusterMetrics(registry, "tiny", top_k=4)
    run_steps(m, {0: 0.01, 1: 0.01, 2: 0.05})
    m.ranks.select({}, [0, 1, 2], 0.0)
    m.ranks.evicted(2, now=10.0)
    m.forget_rank(2)  # the controller forgets the retired rank; its evidence stays
    m.ranks.select({}, [0, 1], 20.0)
    samples = scrape(registry)
    assert samples[("elastic_ep_rank_exported", frozenset({("rank", "2"), ("reason", "evicted")}))] == 1
    assert samples[("elastic_ep_rank_up", frozenset({("rank", "2")}))] == 0
    assert samples[("elastic_ep_rank_step_seconds_count", frozenset({("rank", "2")}))] == 3
    m.ranks.select({}, [0, 1], 10.0 + EVICTED_HOLD_S + 1)
    assert labelled_ranks(scrape(registry)) == {"0", "1"}
    m.ranks.evicted(1, now=0.0)
    m.ranks.select({}, [0, 1], 1.0)  # a new process took id 1: it starts from zero
    assert scrape(registry)[("elastic_ep_rank_step_seconds_count", frozenset({("rank", "1")}))] == 0
