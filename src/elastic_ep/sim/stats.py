"""Small statistics used by the simulators: 95% intervals, time-weighted quantiles."""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054


def t95(dof: int) -> float:
    """Two-sided 95% Student t quantile (Cornish-Fisher expansion; within 0.5% for dof >= 3)."""
    if dof <= 0:
        return math.inf
    z = Z95
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def mean_interval(samples: np.ndarray) -> tuple[float, float | None]:
    """(mean, half-width of its 95% interval) of independent samples [n]; the half-width is None
    for a single sample, which gives no interval."""
    n = len(samples)
    mean = float(np.mean(samples))
    if n < 2:
        return mean, None
    return mean, t95(n - 1) * float(np.std(samples, ddof=1)) / math.sqrt(n)


def wilson_interval(hits: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sane at 0 and 1)."""
    p = hits / n
    denom = 1 + Z95**2 / n
    centre = (p + Z95**2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, qs: list[float]) -> list[float]:
    """Quantiles of `values` [n] where each value holds for `weights` [n] (e.g. durations)."""
    order = np.argsort(values)
    v, w = values[order], weights[order]
    cum = np.cumsum(w) / w.sum()
    return [float(v[min(np.searchsorted(cum, q), len(v) - 1)]) for q in qs]
