"""One simulated fleet and its assumptions (`sim fleet`'s options): sizes, failure and straggler
rates, repair and recovery times, and the straggler verdict and policy `serve` runs (the same
dataclasses and defaults, `policy/`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from elastic_ep.errors import SimulationError
from elastic_ep.policy.straggler_policy import StragglerPolicy
from elastic_ep.policy.straggler_verdict import StragglerRule
from elastic_ep.sim.assumptions import BACKUP_RELOAD_S, DISK_RELOAD_MIN, PAUSE_MIN, RESTART_MIN
from elastic_ep.sim.failure_rates import load_llama3

DURATIONS_AND_RATES = (
    "gpu_repair_h", "node_repair_h", "software_restart_min", "restart_min", "pause_min", "join_min",
    "disk_reload_min", "backup_reload_s", "straggler_h", "rate_per_gpu_hour", "straggler_rate_per_gpu_hour",
)  # fmt: skip


@dataclass(frozen=True)
class FleetConfig:
    """One fleet and its assumptions; times carry their unit in the name."""

    gpus: int = 2048
    days: float = 365.0
    gpus_per_node: int = 8
    ep_size: int = 64
    experts: int = 256
    slots_per_rank: int = 8
    rate_per_gpu_hour: float = field(default_factory=lambda: load_llama3().rate_per_gpu_hour)
    class_shares: dict[str, float] = field(default_factory=lambda: load_llama3().class_shares())
    gpu_repair_h: float = 48.0
    node_repair_h: float = 24.0
    software_restart_min: float = 5.0
    spare_fraction: float = 0.01
    restart_min: float = RESTART_MIN
    pause_min: float = PAUSE_MIN
    join_min: float = 10.0
    disk_reload_min: float = DISK_RELOAD_MIN
    backup_reload_s: float = BACKUP_RELOAD_S
    straggler_rate_per_gpu_hour: float = field(default_factory=lambda: load_llama3().rate_per_gpu_hour)
    straggler_speed: float = 0.6
    straggler_h: float = 4.0
    attention_share: float = 0.5
    straggler_rule: StragglerRule = field(default_factory=StragglerRule)
    straggler_policy: StragglerPolicy = field(default_factory=StragglerPolicy)

    def validate(self) -> None:
        if self.gpus <= 0 or not 0 < self.days < np.inf:
            raise SimulationError(f"--gpus ({self.gpus}) and --days ({self.days}) must be > 0")
        if self.gpus_per_node <= 0 or self.ep_size <= 0:
            raise SimulationError("--gpus-per-node and --ep-size must be > 0")
        if self.ep_size % self.gpus_per_node and self.gpus_per_node % self.ep_size:
            raise SimulationError(
                f"--ep-size {self.ep_size} and --gpus-per-node {self.gpus_per_node}: one must divide the other"
            )
        if self.gpus < self.ep_size:
            raise SimulationError(f"--gpus {self.gpus} cannot hold one EP group of {self.ep_size}")
        if self.experts <= 0 or self.slots_per_rank <= 0:
            raise SimulationError(f"--experts ({self.experts}) and --slots-per-rank ({self.slots_per_rank}) "
                                  "must be > 0")
        if self.ep_size * self.slots_per_rank < self.experts:
            raise SimulationError(
                f"{self.ep_size} ranks x {self.slots_per_rank} slots cannot hold {self.experts} experts: "
                f"give more --slots or a larger --ep-size"
            )
        if not 0 < self.straggler_speed <= 1:
            raise SimulationError(f"--straggler-speed {self.straggler_speed} must be in (0, 1]")
        if not 0 <= self.attention_share <= 1:
            raise SimulationError(f"--attention-share {self.attention_share} must be in [0, 1]")
        if not 0 <= self.spare_fraction <= 1:
            raise SimulationError(
                f"--spare-fraction {self.spare_fraction} must be between 0 and 1 (a fraction of --gpus: 0.01 is 1%)"
            )
        for name in DURATIONS_AND_RATES:
            value = getattr(self, name)
            if not 0 <= value < np.inf:
                flag = "--" + name.replace("_per_gpu_hour", "").replace("_", "-")
                raise SimulationError(f"{flag} {value} must be a number >= 0")

    @property
    def groups(self) -> int:
        return self.gpus // self.ep_size

    @property
    def spare_gpus(self) -> int:
        return int(np.ceil(self.gpus * self.spare_fraction))

    @property
    def hours(self) -> float:
        return self.days * 24


