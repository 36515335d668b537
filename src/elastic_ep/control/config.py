"""Every knob of a deployment, as `elastic-ep serve` flags set it. Every deadline is here with
its default, and `/cluster` shows them all."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServeConfig:
    """Every knob of a deployment; the deadlines (seconds) are shown in /cluster."""

    model_dir: str
    model_name: str
    ep_size: int
    redundant_experts: int = 0
    backend: str = "gloo"
    host: str = "127.0.0.1"
    max_num_seqs: int = 32
    max_model_len: int = 1024
    max_num_batched_tokens: int = 256
    padded_dispatch_max_tokens: int = 16
    expert_backup: bool = True
    enable_eplb: bool = False
    eplb_interval: int = 200
    eplb_threshold: float = 1.3
    eplb_speed_aware: bool = False
    enable_chaos: bool = False
    record_dir: str = "."
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    watchdog_floor_s: float = 1.0
    watchdog_multiple: float = 10.0
    fence_timeout_s: float = 5.0
    drain_timeout_s: float = 5.0
    epoch_timeout_s: float = 30.0
    collective_timeout_s: float = 60.0
    backup_fetch_timeout_s: float = 10.0
    admission_timeout_s: float = 30.0
    degraded_timeout_s: float = 120.0
    startup_timeout_s: float = 120.0
    restart_delay_s: float = 5.0
    max_ep_size: int = 0
    elastic_ep_scale_timeout_s: float = 600.0
    scale_drain_timeout_s: float = 5.0
    health_checks: bool = True
    health_check_period_s: float = 0.02

    @property
    def max_ranks(self) -> int:
        """--max-ep-size, 0 meaning twice --ep-size."""
        return self.max_ep_size or 2 * self.ep_size

    def deadlines(self) -> dict[str, float]:
        return {
            k: v for k, v in vars(self).items() if k.endswith("_s") and isinstance(v, float | int)
        }
