"""Per-rank series in `/metrics`, bounded: at most `--metrics-top-k` ranks get the `rank` label,
and the whole group is seen through histograms without it.

Why: a 12-bucket histogram labelled per rank is 14 series per rank and metric; at 10,000 ranks the
per-rank series alone are hundreds of thousands, which is what breaks a Prometheus server. Means
hide the one slow card, so the group histograms (`elastic_ep_group_*`: one observation per rank per
step) keep the distribution, and the ranks an operator needs by name keep their own series: first
those in trouble (down or being fenced, evicted, stalled, suspect, straggler, derated, DP-heavy),
then the slowest by own time per step (step less collective wait). An evicted rank's process is
gone, but its last series stay for `EVICTED_HOLD_S` (the evidence of why it went), unless a new
process takes its id first. `elastic_ep_rank_exported{rank,reason}`
says why each one is there.

Every rank's counters and histograms are accumulated here whether it is exported or not, so a rank
that leaves the exported set and comes back continues its counters (no false reset for `rate()`
or the doctor); only the export is bounded. A rank that leaves the set has no series at the next
scrape: nothing stale stays behind. The set changes at publishes only, and an exported rank keeps
its place until a newcomer is `STICKINESS` times slower, so ranks of equal speed do not churn
series.

Written by the control thread (`step`, `set_rank`, `select`, `forget`), read by the HTTP thread
(`collect`, under the lock).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from elastic_ep.errors import ElasticEPError

# Why a rank is exported, most urgent first; "slowest" fills the rest of the top-k.
REASONS = ("down", "evicted", "stalled", "suspect", "straggler", "derated", "dp-imbalance", "slowest")
EVICTED_HOLD_S = 600.0  # an evicted rank's series stay (rank_up 0, last timings) this long, or until its id returns
STICKINESS = 1.2  # an exported rank is replaced only by one with 1.2x its own time: no churn among equals
OWN_TIME_SMOOTHING = 0.1  # weight of the newest step in a rank's moving own time (about 10 steps)


def select_ranks(own_s: Mapping[int, float], flagged: Mapping[int, str], top_k: int,
                 previous: Collection[int] = (), stickiness: float = STICKINESS) -> dict[int, str]:
    """The ranks to export, rank -> reason, at most `top_k`.

    own_s: each rank's recent own time per step (s); flagged: rank -> a reason of `REASONS` other
    than "slowest". Flagged ranks come first (most urgent reason, then slowest), then the slowest
    of the others, where a rank in `previous` counts as `stickiness` times slower than it is."""
    assert top_k >= 0, top_k
    rank = {reason: i for i, reason in enumerate(REASONS)}
    urgent = sorted(flagged, key=lambda r: (rank[flagged[r]], -own_s.get(r, 0.0), r))[:top_k]
    chosen = {r: flagged[r] for r in urgent}
    held = set(previous)
    rest = sorted((r for r in own_s if r not in chosen),
                  key=lambda r: (-own_s[r] * (stickiness if r in held else 1.0), r))
    chosen.update((r, "slowest") for r in rest[:top_k - len(chosen)])
    return chosen


@dataclass
class _Histograms:
    """Bucket counts (not cumulative; the last is +Inf) and sums, one row per rank, grown as ranks come."""

    bounds: np.ndarray
    counts: np.ndarray = field(init=False)
    sums: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.zeros((0, len(self.bounds) + 1), dtype=np.int64)
        self.sums = np.zeros(0)

    def grow(self, rows: int) -> None:
        if rows > len(self.sums):
            self.counts = np.vstack([self.counts, np.zeros((rows - len(self.sums), self.counts.shape[1]), np.int64)])
            self.sums = np.concatenate([self.sums, np.zeros(rows - len(self.sums))])

    def observe(self, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
        """One observation per row; returns the bucket of each (for the group's histogram)."""
        buckets = np.searchsorted(self.bounds, values, side="left")  # Prometheus' `le`: value <= bound
        np.add.at(self.counts, (rows, buckets), 1)
        np.add.at(self.sums, rows, values)
        return buckets


def _histogram(name: str, doc: str, bounds: Sequence[float], counts: np.ndarray, total: float,
               labels: dict[str, str], family: HistogramMetricFamily | None = None) -> HistogramMetricFamily:
    family = family or HistogramMetricFamily(name, doc, labels=list(labels))
    cumulative = np.cumsum(counts)
    buckets = ([(_le(b), float(c)) for b, c in zip(bounds, cumulative[:-1], strict=True)]
               + [("+Inf", float(cumulative[-1]))])
    family.add_metric(list(labels.values()), buckets, float(total))
    return family


def _le(bound: float) -> str:
    return repr(float(bound))


class RankSeries:
    """The per-rank and group series of the step loop and the publisher (see the module docstring).
    `top_k`: ranks exported with a `rank` label; `buckets`: the histograms' upper bounds (s)."""

    GAUGES = {
        "elastic_ep_rank_step_tokens": "Tokens the rank ran in the last step (DP attention)",
        "elastic_ep_rank_up": "1 while the rank serves and is not stalled (liveness in /cluster), else 0",
        "elastic_ep_rank_heartbeat_age_seconds": "Time since the rank's last heartbeat",
        "elastic_ep_rank_last_progress_timestamp_seconds":
            "Unix time the rank last moved (entered a collective or phase); alert on time() minus this",
        "elastic_ep_rank_stalled_seconds":
            "How long the rank has been stalled or waiting in a stalled step (0 when live)",
        "elastic_ep_expert_load_imbalance":
            "Tokens computed by the rank's expert slots over the mean across ranks, recent window (1.0 = even)",
    }
    COUNTERS = {
        "elastic_ep_rank_tokens": "Tokens the rank ran (prefill and decode), for tokens per step over a window",
        "elastic_ep_all2all_remote_messages": "Point-to-point sends of the rank's MoE all-to-alls to a rank on "
                                              "another node (gloo sends one per peer per collective, empty ones too)",
        "elastic_ep_all2all_remote_bytes": "Bytes the rank's MoE all-to-alls sent to ranks on other nodes",
    }

    def __init__(self, registry: CollectorRegistry, top_k: int, buckets: Sequence[float]):
        if top_k < 0:
            raise ElasticEPError(f"--metrics-top-k must be >= 0 (ranks with a rank label in /metrics), got {top_k}")
        self.top_k = top_k
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self._lock = threading.Lock()
        self._row: dict[int, int] = {}
        self._step, self._wait = _Histograms(self.bounds), _Histograms(self.bounds)
        n = len(self.bounds) + 1
        self._group = {k: np.zeros(n, np.int64) for k in ("step", "wait", "own")}
        self._group_sum = dict.fromkeys(self._group, 0.0)
        self._own_s = np.zeros(0)  # moving own time per step, per row: what "slowest" ranks by
        self._counters = {name: np.zeros(0) for name in self.COUNTERS}
        self._gauges: dict[str, dict[int, float]] = {name: {} for name in self.GAUGES}
        self.exported: dict[int, str] = {}
        self._evicted: dict[int, float] = {}  # rank -> monotonic time its series go
        registry.register(self)

    def _rows(self, rank_ids: Sequence[int]) -> np.ndarray:
        for r in rank_ids:
            if r not in self._row:
                self._row[r] = len(self._row)
        n = len(self._row)
        self._step.grow(n)
        self._wait.grow(n)
        if n > len(self._own_s):
            extra = n - len(self._own_s)
            self._own_s = np.concatenate([self._own_s, np.full(extra, np.nan)])
            for name, values in self._counters.items():
                self._counters[name] = np.concatenate([values, np.zeros(extra)])
        return np.fromiter((self._row[r] for r in rank_ids), dtype=np.int64, count=len(rank_ids))

    def step(self, rank_ids: Sequence[int], step_s: Sequence[float], wait_s: Sequence[float],
             own_s: Sequence[float], tokens: Sequence[int], remote_messages: Sequence[int],
             remote_bytes: Sequence[int]) -> None:
        """One completed step: per rank (all of `rank_ids`, same order in every argument) its step
        time, collective wait and own time (s), tokens run and what its all-to-alls sent off-node."""
        with self._lock:
            rows = self._rows(rank_ids)
            step, wait, own = (np.asarray(v, dtype=np.float64) for v in (step_s, wait_s, own_s))
            for kind, buckets, values in (("step", self._step.observe(rows, step), step),
                                          ("wait", self._wait.observe(rows, wait), wait),
                                          ("own", np.searchsorted(self.bounds, own, side="left"), own)):
                self._group[kind] += np.bincount(buckets, minlength=len(self.bounds) + 1)
                self._group_sum[kind] += float(values.sum())
            before = self._own_s[rows]
            self._own_s[rows] = np.where(np.isnan(before), own,
                                         OWN_TIME_SMOOTHING * own + (1 - OWN_TIME_SMOOTHING) * before)
            for name, values in (("elastic_ep_rank_tokens", tokens),
                                 ("elastic_ep_all2all_remote_messages", remote_messages),
                                 ("elastic_ep_all2all_remote_bytes", remote_bytes)):
                np.add.at(self._counters[name], rows, np.asarray(values, dtype=np.float64))
            tokens_now = self._gauges["elastic_ep_rank_step_tokens"]
            for r, n in zip(rank_ids, tokens, strict=True):
                tokens_now[r] = n

    def set_gauge(self, name: str, values: Mapping[int, float]) -> None:
        """Set gauge `name` (one of `GAUGES`) for the ranks in `values`; other ranks keep theirs."""
        with self._lock:
            self._gauges[name].update(values)

    def own_s(self) -> dict[int, float]:
        """Every rank's moving own time per step (s), for ranks with a step."""
        with self._lock:
            return {r: float(self._own_s[i]) for r, i in self._row.items() if not np.isnan(self._own_s[i])}

    def evicted(self, rank_id: int, now: float) -> None:
        """The rank was evicted: keep its series, marked, up to EVICTED_HOLD_S (`forget` waits)."""
        self._evicted[rank_id] = now + EVICTED_HOLD_S
        self.set_gauge("elastic_ep_rank_up", {rank_id: 0})

    def select(self, flagged: Mapping[int, str], candidates: Collection[int], now: float) -> dict[int, str]:
        """Choose the exported ranks among `candidates` (ranks that exist now) and the recently
        evicted ones with `select_ranks`; `now` is monotonic."""
        for r, until in list(self._evicted.items()):
            if now > until or r in candidates:  # held long enough, or a new process has its id
                del self._evicted[r]
                self.forget(r)
        flagged = {**flagged, **dict.fromkeys(self._evicted, "evicted")}
        candidates = set(candidates) | set(self._evicted)
        own = {r: s for r, s in self.own_s().items() if r in candidates}
        own.update((r, 0.0) for r in candidates if r not in own)
        chosen = select_ranks(own, {r: why for r, why in flagged.items() if r in candidates}, self.top_k,
                              self.exported)
        with self._lock:
            self.exported = chosen
        return chosen

    def forget(self, rank_id: int) -> None:
        """A rank left (its process is gone): drop its values; a new process of that id starts from
        zero. An evicted rank's values are kept until `select` lets them go."""
        if rank_id in self._evicted:
            return
        with self._lock:
            self.exported.pop(rank_id, None)
            for values in self._gauges.values():
                values.pop(rank_id, None)
            i = self._row.get(rank_id)
            if i is None:
                return
            self._step.counts[i] = self._wait.counts[i] = 0
            self._step.sums[i] = self._wait.sums[i] = 0.0
            self._own_s[i] = np.nan
            for values in self._counters.values():
                values[i] = 0.0

    def describe(self) -> list[Metric]:
        return []  # families are built at each scrape; nothing to check against other collectors

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield from self._group_families()
            yield from self._rank_families()

    def _group_families(self) -> Iterator[Metric]:
        for kind, name, doc in (
                ("step", "elastic_ep_group_step_seconds", "Step time of every rank, one observation per rank per step"),
                ("wait", "elastic_ep_group_collective_wait_seconds",
                 "Time every rank spent in the dispatch and combine all-to-alls, one observation per rank per step"),
                ("own", "elastic_ep_group_own_seconds",
                 "Own time (step less collective wait) of every rank, one observation per rank per step")):
            yield _histogram(name, doc, self.bounds, self._group[kind], self._group_sum[kind], {})
        yield GaugeMetricFamily("elastic_ep_metrics_exported_ranks", "Ranks exported with a rank label now "
                                "(at most --metrics-top-k)", value=len(self.exported))

    def _rank_families(self) -> Iterator[Metric]:
        ranks = sorted(self.exported)
        exported = GaugeMetricFamily("elastic_ep_rank_exported", "1 for each rank exported with a rank label, with "
                                     "the reason (down, evicted, stalled, suspect, straggler, derated, "
                                     "dp-imbalance, slowest)",
                                     labels=["rank", "reason"])
        for r in ranks:
            exported.add_metric([str(r), self.exported[r]], 1)
        yield exported
        rows = [(r, self._row[r]) for r in ranks if r in self._row]
        for hist, name, doc in (
                (self._step, "elastic_ep_rank_step_seconds", "Step time of an exported rank (worker side)"),
                (self._wait, "elastic_ep_rank_collective_wait_seconds",
                 "Time per step an exported rank spent in the dispatch and combine all-to-alls")):
            family = HistogramMetricFamily(name, doc, labels=["rank"])
            for r, i in rows:
                _histogram(name, doc, self.bounds, hist.counts[i], hist.sums[i], {"rank": str(r)}, family)
            yield family
        for name, doc in self.COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["rank"])
            for r, i in rows:
                family.add_metric([str(r)], float(self._counters[name][i]))
            yield family
        for name, doc in self.GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["rank"])
            values = self._gauges[name]
            for r in ranks:
                if r in values:
                    family.add_metric([str(r)], values[r])
            yield family
