"""The per-rank series kept as numpy rows scrape exactly as prometheus_client's own would (their
`_created` samples aside), and a rank that leaves takes its series with it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from elastic_ep.control.rank_metrics import RankCounter, RankGauge, RankHistogram

BUCKETS = (0.001, 0.01, 0.1)
OBSERVED = [(3, 0.0005), (1, 0.01), (3, 0.2), (1, 0.001), (7, 0.05), (12, 0.1)]


def scrape(registry: CollectorRegistry) -> list[str]:
    return sorted(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)


def test_same_exposition_as_prometheus_client():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "doc", ["rank"], buckets=BUCKETS, registry=theirs)
    c = Counter("x_tokens", "doc", ["rank"], registry=theirs)
    g = Gauge("x_step_tokens", "doc", ["rank"], registry=theirs)
    rh, rc, rg = (RankHistogram("x_seconds", "doc", BUCKETS, ours), RankCounter("x_tokens", "doc", ours),
                  RankGauge("x_step_tokens", "doc", ours))
    for rank, v in OBSERVED:
        h.labels(str(rank)).observe(v)
        c.labels(str(rank)).inc(v * 100)
        g.labels(str(rank)).set(v)
    ranks, values = [r for r, _ in OBSERVED], [v for _, v in OBSERVED]
    for rank, v in OBSERVED:  # one observation per rank and step, as the step loop makes them
        rh.observe([rank], [v])
    rc.inc(ranks, [v * 100 for v in values])
    rg.set(ranks, values)
    assert scrape(ours) == scrape(theirs)


def test_a_removed_rank_leaves_and_the_others_keep_their_values():
    registry = CollectorRegistry()
    counter = RankCounter("x_tokens", "doc", registry)
    counter.inc([0, 1, 2], [5, 6, 7])
    counter.remove(0)
    counter.inc([3], [8])
    text = generate_latest(registry).decode()
    assert 'rank="0"' not in text
    assert 'x_tokens_total{rank="1"} 6.0' in text and 'x_tokens_total{rank="2"} 7.0' in text
    assert 'x_tokens_total{rank="3"} 8.0' in text
