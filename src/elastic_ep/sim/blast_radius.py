"""Blast radius: what one GPU failure costs when the whole EP group stops with it.

The number of failures depends only on the number of GPUs; the cost of each one is the
group size times the time the group stands still (a whole-group restart, or the short pause
of an elastic recovery).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_ep.errors import SimulationError
from elastic_ep.sim.assumptions import PAUSE_MIN, RESTART_MIN

HOURS_PER_MONTH = 30 * 24


@dataclass(frozen=True)
class BlastRow:
    """One EP group size: how often a group fails and what the fleet loses a month."""

    group_size: int
    groups: int
    mtbf_days: float
    gpu_hours_lost_restart: float
    gpu_hours_lost_elastic: float


@dataclass(frozen=True)
class BlastReport:
    total_gpus: int
    rate_per_gpu_hour: float
    failures_per_month: float
    restart_min: float
    pause_min: float
    rows: list[BlastRow]


def blast_radius(
    total_gpus: int,
    group_sizes: list[int],
    rate_per_gpu_hour: float,
    restart_min: float = RESTART_MIN,
    pause_min: float = PAUSE_MIN,
) -> BlastReport:
    """GPU-hours lost a month per group size, whole-group restart against elastic pause.

    restart_min: how long a whole-group restart stops the group (reload, graph capture, warmup).
    pause_min: how long an elastic recovery pauses the group.
    """
    if total_gpus <= 0:
        raise SimulationError(f"--gpus {total_gpus} must be > 0")
    if not (0 <= restart_min < math.inf and 0 <= pause_min < math.inf):
        raise SimulationError("--restart-min and --pause-min must be >= 0 minutes")
    if not group_sizes:
        raise SimulationError("--group-sizes is empty: give at least one EP group size")
    for size in group_sizes:
        if not 0 < size <= total_gpus:
            raise SimulationError(f"EP group size {size} must be between 1 and --gpus {total_gpus}")
    failures = total_gpus * rate_per_gpu_hour * HOURS_PER_MONTH
    rows = [
        BlastRow(
            group_size=size,
            groups=total_gpus // size,
            mtbf_days=1 / (size * rate_per_gpu_hour) / 24,
            gpu_hours_lost_restart=failures * size * restart_min / 60,
            gpu_hours_lost_elastic=failures * size * pause_min / 60,
        )
        for size in group_sizes
    ]
    return BlastReport(total_gpus, rate_per_gpu_hour, failures, restart_min, pause_min, rows)
