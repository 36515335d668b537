"""Per-rank series that change every step, kept as numpy rows and rendered when /metrics is
scraped: a step updates every rank's value with one vectorised operation instead of a labelled
child lookup and a locked update per rank and series (at 1,024 ranks that was milliseconds per
step, on the control thread). The exposition is prometheus_client's for the same kinds (a
histogram's cumulative `le` buckets, `_count`, `_sum`; a counter's `_total`), so scrapers and
`elastic-ep doctor` read them as before; only the `_created` samples are not written.

The control thread writes, the HTTP thread's scrape reads: one lock between them, held for a
vectorised update or a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class _RankRows(Collector):
    """rank_id -> a row of `width` float64 values."""

    def __init__(self, name: str, documentation: str, width: int, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._rows: dict[int, int] = {}
        self._values = np.zeros((0, width))
        self._lock = threading.Lock()
        registry.register(self)

    def _indices(self, ranks: Sequence[int]) -> np.ndarray:
        for r in ranks:
            if r not in self._rows:
                self._rows[r] = len(self._rows)
        if len(self._rows) > len(self._values):
            grown = np.zeros((max(2 * len(self._values), len(self._rows), 8), self._values.shape[1]))
            grown[: len(self._values)] = self._values
            self._values = grown
        return np.fromiter((self._rows[r] for r in ranks), dtype=np.int64, count=len(ranks))

    def remove(self, rank: int) -> None:
        """Drop the rank's series (its row is kept, zeroed, for a rank that comes back)."""
        with self._lock:
            row = self._rows.pop(rank, None)
            if row is not None:
                self._values[row] = 0.0
                self._free(row)

    def _free(self, row: int) -> None:
        # a later rank may take the row: keep the mapping dense by moving the last row into it
        last = len(self._rows)
        if row != last:
            moved = next((r for r, i in self._rows.items() if i == last), None)
            if moved is not None:
                self._values[row] = self._values[last]
                self._values[last] = 0.0
                self._rows[moved] = row

    def _snapshot(self) -> tuple[dict[int, int], np.ndarray]:
        with self._lock:
            return dict(self._rows), self._values[: len(self._rows)].copy()

    def describe(self):
        return []


class RankHistogram(_RankRows):
    """A histogram per rank with fixed `buckets` (upper bounds, +Inf added)."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry):
        self.bounds = np.asarray(tuple(buckets), dtype=np.float64)
        super().__init__(name, documentation, len(self.bounds) + 2, registry)  # buckets, +Inf, sum

    def observe(self, ranks: Sequence[int], values: Sequence[float]) -> None:
        """One observation per rank: values[i] of ranks[i]."""
        v = np.asarray(values, dtype=np.float64)
        bucket = np.searchsorted(self.bounds, v, side="left")  # the first bound >= v (prometheus' le)
        with self._lock:
            rows = self._indices(ranks)
            np.add.at(self._values, (rows, bucket), 1.0)
            np.add.at(self._values, (rows, len(self.bounds) + 1), v)

    def collect(self):
        rows, values = self._snapshot()
        family = HistogramMetricFamily(self.name, self.documentation, labels=["rank"])
        names = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for rank, row in rows.items():
            cumulative = np.cumsum(values[row, :-1])
            family.add_metric([str(rank)], list(zip(names, cumulative.tolist(), strict=True)), float(values[row, -1]))
        yield family


class RankCounter(_RankRows):
    def __init__(self, name: str, documentation: str, registry: CollectorRegistry):
        super().__init__(name, documentation, 1, registry)

    def inc(self, ranks: Sequence[int], amounts: Sequence[float]) -> None:
        with self._lock:
            rows = self._indices(ranks)
            np.add.at(self._values, (rows, 0), np.asarray(amounts, dtype=np.float64))

    def collect(self):
        rows, values = self._snapshot()
        family = CounterMetricFamily(self.name, self.documentation, labels=["rank"])
        for rank, row in rows.items():
            family.add_metric([str(rank)], float(values[row, 0]))
        yield family


class RankGauge(_RankRows):
    def __init__(self, name: str, documentation: str, registry: CollectorRegistry):
        super().__init__(name, documentation, 1, registry)

    def set(self, ranks: Sequence[int], values: Sequence[float]) -> None:
        with self._lock:
            rows = self._indices(ranks)
            self._values[rows, 0] = np.asarray(values, dtype=np.float64)

    def collect(self):
        rows, values = self._snapshot()
        family = GaugeMetricFamily(self.name, self.documentation, labels=["rank"])
        for rank, row in rows.items():
            family.add_metric([str(rank)], float(values[row, 0]))
        yield family
