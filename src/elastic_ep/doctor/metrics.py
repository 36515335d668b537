"""The engine metrics the doctor reads from GET /metrics, and per-rank figures over the window
between two scrapes (a window, not since start: a rank that turned slow a minute ago must not
be averaged away by the hour before)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

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


@dataclass(frozen=True)
class RankWindow:
    """One rank's steps between two scrapes: mean step time, mean time waiting in the
    all-to-alls, and their difference, the rank's own time (attention, experts, sampling)."""

    steps: int
    step_ms: float
    wait_ms: float

    @property
    def own_ms(self) -> float:
        return self.step_ms - self.wait_ms


def rank_windows(before: Samples, after: Samples) -> dict[int, RankWindow]:
    """Per rank, from the step and collective-wait histograms of both scrapes; ranks with no
    step in the window are left out."""
    step = "elastic_ep_rank_step_seconds"
    wait = "elastic_ep_rank_collective_wait_seconds"
    count_before = per_rank(before, f"{step}_count")
    counts = {k: v - count_before.get(k, 0.0) for k, v in per_rank(after, f"{step}_count").items()}
    step_after, step_before = per_rank(after, f"{step}_sum"), per_rank(before, f"{step}_sum")
    wait_after, wait_before = per_rank(after, f"{wait}_sum"), per_rank(before, f"{wait}_sum")
    out = {}
    for rank, n in counts.items():
        if n < 1:
            continue
        step_s = step_after[rank] - step_before.get(rank, 0.0)
        wait_s = wait_after.get(rank, 0.0) - wait_before.get(rank, 0.0)
        out[rank] = RankWindow(int(n), 1000 * step_s / n, 1000 * wait_s / n)
    return out
