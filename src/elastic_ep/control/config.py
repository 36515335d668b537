"""Every knob of a deployment, as `elastic-ep serve` flags set it. Every deadline is here with
its default, and `/cluster` shows them all."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_ep.errors import ElasticEPError
from elastic_ep.model.config import MoEConfig
from elastic_ep.policy.straggler import StragglerRule


@dataclass
class ServeConfig:
    """Every knob of a deployment; the deadlines (seconds) are shown in /cluster."""

    model_dir: str
    model_name: str
    ep_size: int
    redundant_experts: int = 0
    backend: str = "gloo"
    host: str = "127.0.0.1"
    advertise_host: str = ""
    max_num_seqs: int = 32
    max_model_len: int = 1024
    max_num_batched_tokens: int = 256
    reprefill_tokens_per_step: int = 64
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
    exit_poll_interval_s: float = 0.005
    expert_sweep_interval_s: float = 0.5
    expert_sweep_slots: int = 4
    rebalance_move_bytes: int = 32 * 2**20
    rebalance_every_steps: int = 1
    isolation_max_steps: int = 24
    heartbeat_suspect_s: float = 0.5
    stall_floor_s: float = 1.0
    stall_multiple: float = 10.0
    straggler_ratio: float = 1.5
    straggler_min_excess_ms: float = 2.0
    straggler_window_s: float = 5.0
    straggler_min_steps: int = 10
    straggler_persistence: float = 0.8
    log_stats_interval_s: float = 10.0
    agent_timeout_s: float = 1.0
    lease_s: float = 5.0

    @property
    def control_host(self) -> str:
        """Where the control plane and the store bind and what agents and workers reach:
        --advertise-host, else --host."""
        return self.advertise_host or self.host

    @property
    def max_ranks(self) -> int:
        """--max-ep-size, 0 meaning twice --ep-size."""
        return self.max_ep_size or 2 * self.ep_size

    def straggler_rule(self) -> StragglerRule:
        """The straggler verdict's rule (policy/straggler.py) from the --straggler-* flags."""
        return StragglerRule(self.straggler_ratio, self.straggler_min_excess_ms, self.straggler_window_s,
                             self.straggler_min_steps, self.straggler_persistence)

    def deadlines(self) -> dict[str, float]:
        return {
            k: v for k, v in vars(self).items() if k.endswith("_s") and isinstance(v, float | int)
        }


def check_config(cfg: ServeConfig, config: MoEConfig) -> int:
    """Refuse a deployment that cannot start, naming the flag to change; returns slots per rank."""
    if cfg.control_host in ("0.0.0.0", "::", ""):
        raise ElasticEPError(
            f"--host {cfg.host} listens on every interface, but agents and workers need one address to reach the "
            "controller: pass this host's address with --advertise-host")
    total_slots = config.num_experts + cfg.redundant_experts
    if cfg.ep_size < 1 or total_slots % cfg.ep_size:
        raise ElasticEPError(
            f"{config.num_experts} experts + {cfg.redundant_experts} redundant = {total_slots} slots do not split "
            f"evenly over --ep-size {cfg.ep_size}; choose --redundant-experts so the sum is a multiple of it"
        )
    for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "eplb_interval", "rebalance_move_bytes",
                 "rebalance_every_steps"):
        if getattr(cfg, name) < 1:
            raise ElasticEPError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.max_model_len > config.max_position_embeddings:
        raise ElasticEPError(
            f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}; lower it"
        )
    cfg.straggler_rule()  # refuses a rule that cannot work, naming the value
    if cfg.max_ranks < cfg.ep_size:
        raise ElasticEPError(f"--max-ep-size {cfg.max_ep_size} is below --ep-size {cfg.ep_size}; raise it")
    return total_slots // cfg.ep_size
