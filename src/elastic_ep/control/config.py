"""Every knob of a deployment, as `elastic-ep serve` flags set it. Every deadline is here with
its default, and `/cluster` shows them all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_ep.errors import ElasticEPError, PlacementError
from elastic_ep.model.config import MoEConfig
from elastic_ep.placement.redundancy import Survival, choose_redundant_experts, losses_survived
from elastic_ep.policy.straggler_policy import StragglerPolicy, from_flags
from elastic_ep.policy.straggler_verdict import StragglerRule


@dataclass
class ServeConfig:
    """Every knob of a deployment; the deadlines (seconds) are shown in /cluster."""

    model_dir: str
    model_name: str
    ep_size: int
    redundant_experts: int | str = "auto"  # a count, or "auto"
    ranks_per_node: int = 0  # for --redundant-experts auto: ranks a node runs (0: one node, or not known)
    backend: str = "gloo"
    dtype: str = "auto"
    device: str = "auto"
    host: str = "127.0.0.1"
    advertise_host: str = ""
    max_num_seqs: int = 32
    max_model_len: int = 1024
    max_num_batched_tokens: int = 256
    reprefill_tokens_per_step: int = 64
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int = 0
    num_gpu_blocks_override: int = 0
    enable_prefix_caching: bool = True
    prefix_wait: bool = True
    async_scheduling: bool = False
    send_ahead_steps: int = 0
    padded_dispatch_max_tokens: int = 16
    enable_dbo: bool = False
    dbo_min_tokens: int = 2
    all2all_backend: str = "flat"
    dp_align: bool = True
    dp_align_min_chunk: int = 32
    dp_migrate: str = "kv"
    dp_migrate_patience: int = 8
    expert_backup: bool = True
    read_once: bool = True
    load_read_rate_mb_s: float = 0.0
    warmup_gate: bool = True
    enable_eplb: bool = False
    eplb_interval: int = 200
    eplb_threshold: float = 1.3
    eplb_speed_aware: bool = False
    # 16 cuts the step results' bytes, but the recorder then misses a window's last sums
    load_report_every_steps: int = 1
    enable_chaos: bool = False
    record_dir: str = "."
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    load_heartbeat_timeout_s: float = 30.0
    watchdog_floor_s: float = 1.0
    watchdog_multiple: float = 10.0
    # a member's answer to a step, missing this long after the step was sent (with its heartbeats
    # saying it is not inside the step), is asked for again: max(floor, multiple x median recent
    # step), well above a slow step, whose ranks are inside it anyway and never asked; the floor is
    # what a lost answer pauses the group
    result_timeout_floor_s: float = 2.0
    result_timeout_multiple: float = 10.0
    resend_timeout_s: float = 1.0  # a rank asked to resend that does not answer within this is a fault
    step_plans_via: str = "direct"  # "agent": a node's plans in one frame to its agent, which relays them
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
    # the straggler verdict and policy: defaults are those of policy/ (one definition with `sim fleet`)
    straggler_ratio: float = StragglerRule.ratio
    straggler_min_excess_ms: float = StragglerRule.min_excess_ms
    straggler_window_s: float = StragglerRule.window_s
    straggler_min_steps: int = StragglerRule.min_steps
    straggler_persistence: float = StragglerRule.persistence
    straggler_policy: str = StragglerPolicy.action.value
    straggler_evict_after_s: float = StragglerPolicy.evict_after_s
    straggler_clear_after_s: float = StragglerPolicy.clear_after_s
    straggler_max_evictions: int = StragglerPolicy.max_evictions
    straggler_eviction_window_s: float = StragglerPolicy.eviction_window_s
    standby_ranks: int = 0
    hardware_interval_s: float = 1.0
    log_stats_interval_s: float = 10.0
    agent_timeout_s: float = 1.0
    lease_s: float = 5.0
    # observability: per-rank series bound; OpenTelemetry traces (off without an endpoint)
    metrics_top_k: int = 16
    otlp_traces_endpoint: str = ""
    trace_sample_ratio: float = 1.0

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
        """The straggler verdict's rule (policy/straggler_verdict.py) from the --straggler-* flags."""
        return from_flags(vars(self))[0]

    def straggler_policy_params(self) -> StragglerPolicy:
        """What is done about a straggler (policy/straggler_policy.py), from the --straggler-policy,
        --straggler-evict-after-s, ... flags."""
        return from_flags(vars(self))[1]

    def data_plane(self) -> dict[str, Any]:
        """The knobs of the long tail at the all-to-all, as /cluster shows them."""
        return {name: getattr(self, name) for name in (
            "all2all_backend", "enable_dbo", "dbo_min_tokens", "padded_dispatch_max_tokens", "dp_align",
            "dp_align_min_chunk", "dp_migrate", "dp_migrate_patience")}

    def deadlines(self) -> dict[str, float]:
        return {
            k: v for k, v in vars(self).items() if k.endswith("_s") and isinstance(v, float | int)
        }


@dataclass(frozen=True)
class Redundancy:
    """The redundant expert slots a deployment runs with and what they buy (placement/redundancy.py)."""

    redundant_experts: int
    slots_per_rank: int
    survives: Survival
    extra_bytes: int  # the redundant slots over the whole group, every MoE layer
    chosen: str  # "auto" or "explicit"

    def view(self) -> dict[str, Any]:
        return {"redundant_experts": self.redundant_experts, "slots_per_rank": self.slots_per_rank,
                "survives": {"rank_losses": self.survives.rank_losses, "node_losses": self.survives.node_losses},
                "extra_bytes": self.extra_bytes, "chosen": self.chosen}

    def describe(self) -> str:
        nodes = f", or losing its {self.survives.node_losses} largest node(s)" if self.survives.node_losses else ""
        return (f"{self.redundant_experts} redundant expert slots ({self.chosen}): "
                f"{self.slots_per_rank} slots per rank; "
                f"the group holds every expert after losing any {self.survives.rank_losses} rank(s){nodes}; the "
                f"extra slots take {self.extra_bytes / 2**30:.3g} GiB over the group")


def resolve_redundancy(cfg: ServeConfig, config: MoEConfig, expert_nbytes: int) -> Redundancy:
    """--redundant-experts: auto chooses the fewest extra slots with which the group outlives one
    rank (or, with --local-ranks below --ep-size, its largest node); a count is checked. Raises
    ElasticEPError naming the fix."""
    layers, per_node = len(config.moe_layers), cfg.ranks_per_node or None
    try:
        if cfg.redundant_experts == "auto":
            choice = choose_redundant_experts(config.num_experts, cfg.ep_size, layers, expert_nbytes,
                                              ranks_per_node=per_node)
            return Redundancy(choice.redundant_experts, choice.slots_per_rank, choice.survives, choice.extra_bytes,
                              "auto")
        count = int(cfg.redundant_experts)
        survives = losses_survived(config.num_experts, cfg.ep_size, count, ranks_per_node=per_node)
    except PlacementError as e:
        raise ElasticEPError(f"--redundant-experts / --ep-size: {e}") from None
    return Redundancy(count, (config.num_experts + count) // cfg.ep_size, survives, count * layers * expert_nbytes,
                      "explicit")


def check_config(cfg: ServeConfig, config: MoEConfig, expert_nbytes: int) -> Redundancy:
    """Refuse a deployment that cannot start, naming the flag to change; returns its redundancy."""
    if cfg.control_host in ("0.0.0.0", "::", ""):
        raise ElasticEPError(
            f"--host {cfg.host} listens on every interface, but agents and workers need one address to reach the "
            "controller: pass this host's address with --advertise-host")
    if cfg.ep_size < 1:
        raise ElasticEPError(f"--ep-size must be at least 1, got {cfg.ep_size}")
    if cfg.ep_size > config.num_experts:
        raise ElasticEPError(
            f"--ep-size {cfg.ep_size} exceeds the model's {config.num_experts} routed experts per layer: beyond that "
            f"a rank holds no expert of its own, only copies; use --ep-size {config.num_experts} or fewer "
            "(--redundant-experts adds copies)")
    redundancy = resolve_redundancy(cfg, config, expert_nbytes)
    for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "eplb_interval", "rebalance_move_bytes",
                 "rebalance_every_steps", "block_size", "load_report_every_steps"):
        if getattr(cfg, name) < 1:
            raise ElasticEPError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.send_ahead_steps < 0:
        raise ElasticEPError(f"--send-ahead-steps must be at least 0, got {cfg.send_ahead_steps}")
    if cfg.send_ahead_steps and not cfg.async_scheduling:
        raise ElasticEPError(f"--send-ahead-steps {cfg.send_ahead_steps} sends steps planned while the one before "
                             "runs, which only --async-scheduling plans: add --async-scheduling, or drop "
                             "--send-ahead-steps")
    if cfg.max_model_len > config.max_position_embeddings:
        raise ElasticEPError(
            f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}; lower it"
        )
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ElasticEPError(f"--gpu-memory-utilization is a fraction of the device's memory in (0, 1], got "
                             f"{cfg.gpu_memory_utilization}")
    for name in ("kv_cache_memory", "num_gpu_blocks_override"):
        if getattr(cfg, name) < 0:
            raise ElasticEPError(f"--{name.replace('_', '-')} must be >= 0 (0: from the budget), "
                                 f"got {getattr(cfg, name)}")
    from_flags(vars(cfg))  # refuses a rule or policy that cannot work, naming the value
    if cfg.standby_ranks < 0:
        raise ElasticEPError(f"--standby-ranks must be >= 0, got {cfg.standby_ranks}")
    if not cfg.hardware_interval_s > 0:
        raise ElasticEPError(f"--hardware-interval-s must be > 0, got {cfg.hardware_interval_s}")
    for name in ("dbo_min_tokens", "dp_align_min_chunk", "dp_migrate_patience"):
        if getattr(cfg, name) < 1:
            raise ElasticEPError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.max_ranks < cfg.ep_size:
        raise ElasticEPError(f"--max-ep-size {cfg.max_ep_size} is below --ep-size {cfg.ep_size}; raise it")
    return redundancy
