"""What `sim fleet` reports: each recovery policy's metrics over the replications, with 95%
intervals, and the capacity series of one replication."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_ep.sim.fleet_config import FleetConfig
from elastic_ep.sim.stats import mean_interval, weighted_quantiles

CAPACITY_QUANTILES = (0.01, 0.05, 0.5)


@dataclass(frozen=True)
class RunResult:
    """One policy over one replication. capacity_t/capacity: [n] breakpoints of the fleet's
    serving capacity as a fraction of its active GPUs."""

    policy: str
    failures: int
    expert_loss_events: int
    evictions: int
    serving_gpu_h: float
    stopped_gpu_h: float
    degraded_gpu_h: float
    slow_gpu_h: float
    availability: float
    goodput: float
    capacity_t: np.ndarray
    capacity: np.ndarray


@dataclass(frozen=True)
class Metric:
    """A mean over replications and the half-width of its 95% interval (None from one replication)."""

    mean: float
    half_width: float | None


@dataclass(frozen=True)
class PolicySummary:
    """A policy over all replications: each metric with its 95% interval."""

    policy: str
    gpu_hours_lost: Metric
    stopped_gpu_h: Metric
    degraded_gpu_h: Metric
    slow_gpu_h: Metric
    availability: Metric
    goodput: Metric
    expert_loss_events: Metric
    evictions: Metric
    capacity_quantiles: dict[str, Metric]
    capacity_min: Metric


@dataclass(frozen=True)
class FleetReport:
    """`straggler_policy`: which straggler policy the elastic policies ran, in words."""

    config: FleetConfig
    straggler_policy: str
    replications: int
    failures: Metric
    policies: list[PolicySummary]
    example_runs: list[RunResult]




def metric(values: list[float]) -> Metric:
    return Metric(*mean_interval(np.asarray(values, dtype=np.float64)))


def summarise(cfg: FleetConfig, policy: str, runs: list[RunResult]) -> PolicySummary:
    total = cfg.groups * cfg.ep_size * cfg.hours
    quantiles = [_capacity_quantiles(r, cfg.hours) for r in runs]
    return PolicySummary(
        policy=policy,
        gpu_hours_lost=metric([total - r.serving_gpu_h for r in runs]),
        stopped_gpu_h=metric([r.stopped_gpu_h for r in runs]),
        degraded_gpu_h=metric([r.degraded_gpu_h for r in runs]),
        slow_gpu_h=metric([r.slow_gpu_h for r in runs]),
        availability=metric([r.availability for r in runs]),
        goodput=metric([r.goodput for r in runs]),
        expert_loss_events=metric([r.expert_loss_events for r in runs]),
        evictions=metric([r.evictions for r in runs]),
        capacity_quantiles={
            f"p{round(q * 100)}": metric([qs[i] for qs in quantiles])
            for i, q in enumerate(CAPACITY_QUANTILES)
        },
        capacity_min=metric([float(r.capacity.min()) for r in runs]),
    )


def _capacity_quantiles(run: RunResult, hours: float) -> list[float]:
    """Time-weighted quantiles of the fleet's serving capacity fraction."""
    durations = np.diff(np.append(run.capacity_t, hours))
    return weighted_quantiles(run.capacity, durations, list(CAPACITY_QUANTILES))
