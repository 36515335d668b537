"""The engine metrics the doctor reads from GET /metrics, and per-rank figures between scrapes
(a window, not since start: a rank that turned slow a minute ago must not be averaged away by
the hour before), as the intervals the straggler verdict (policy/straggler.py) judges."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.policy.straggler_verdict import Interval, RankInterval

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Prometheus text -> {(sample name, sorted label pairs): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def per_rank(samples: Samples, name: str) -> dict[int, float]:
    """{rank: value} of a series labelled by `rank`."""
    out = {}
    for (n, labels), v in samples.items():
        label = dict(labels).get("rank")
        if n == name and label is not None:
            out[int(label)] = v
    return out


def scalar(samples: Samples, name: str) -> float | None:
    return samples.get((name, ()))


def rank_interval(before: Samples, after: Samples) -> dict[int, RankInterval]:
    """Per rank, its steps between two scrapes: how many, its own time (step time less collective
    wait, summed, s) and the tokens it ran; ranks with no step in between, or not exported in both
    scrapes, are left out."""
    step, wait, tokens = ("elastic_ep_rank_step_seconds", "elastic_ep_rank_collective_wait_seconds",
                          "elastic_ep_rank_tokens_total")

    def delta(name: str) -> dict[int, float]:
        # only ranks in both scrapes: /metrics exports --metrics-top-k ranks, and one that joined that set
        # between the scrapes carries counters from before the window (and one that restarted, a reset)
        earlier = per_rank(before, name)
        return {r: v - earlier[r] for r, v in per_rank(after, name).items() if r in earlier and v >= earlier[r]}

    steps, step_s, wait_s, ran = delta(f"{step}_count"), delta(f"{step}_sum"), delta(f"{wait}_sum"), delta(tokens)
    return {r: RankInterval(int(n), step_s.get(r, 0.0) - wait_s.get(r, 0.0), int(round(ran.get(r, 0.0))))
            for r, n in steps.items() if n >= 1}


def scrape_intervals(scrapes: Sequence[tuple[float, Samples]]) -> list[Interval]:
    """The intervals between consecutive scrapes (time_s, samples), for the straggler verdict."""
    return [Interval(t0, t1, rank_interval(a, b)) for (t0, a), (t1, b) in itertools.pairwise(scrapes)]
