"""The deployment planner: EP size, redundant experts and backup, side by side.

For each option: the GPU memory its expert slots take, the chance that a failure loses an
expert (in any layer; random per-layer placements with replicas on distinct ranks), and the
GPU-hours lost a month, whole-group restart against elastic recovery (pause plus reloading
lost experts from the host-memory backup or from disk). Then the option to take, and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from elastic_ep.errors import SimulationError
from elastic_ep.sim.assumptions import BACKUP_RELOAD_S, DISK_RELOAD_MIN, PAUSE_MIN, RESTART_MIN
from elastic_ep.sim.blast_radius import HOURS_PER_MONTH
from elastic_ep.sim.failure_rates import load_llama3
from elastic_ep.sim.redundancy import (
    RandomConfig,
    domain_map,
    exact_loss_probability,
    random_placements,
    replica_domain_sets,
)

MB_PER_GB = 1000


@dataclass(frozen=True)
class PlanInputs:
    """The model, the fleet and the assumptions; memory in decimal GB/MB as vendors quote it."""

    experts: int = 256
    layers: int = 58
    expert_mb: float = 44.0
    gpus: int = 2048
    gpu_mem_gb: float = 141.0
    other_gb: float = 40.0
    min_free_gb: float = 20.0
    gpus_per_node: int = 8
    rate_per_gpu_hour: float = field(default_factory=lambda: load_llama3().rate_per_gpu_hour)
    node_share: float = field(default_factory=lambda: load_llama3().class_shares()["node"])
    restart_min: float = RESTART_MIN
    pause_min: float = PAUSE_MIN
    disk_reload_min: float = DISK_RELOAD_MIN
    backup_reload_s: float = BACKUP_RELOAD_S


@dataclass(frozen=True)
class PlanOption:
    """One option. `loss_p_rank`/`loss_p_node`: chance that one dead rank / one dead node loses
    some expert in some layer; `loss_p_failure` mixes them by the failure cause mix."""

    ep_size: int
    redundant: int
    backup: bool
    slots_per_rank: int
    expert_gb_per_gpu: float
    redundancy_gb_per_group: float
    backup_gb_per_node: float
    fits: bool
    loss_p_rank: float
    loss_p_node: float
    loss_p_failure: float
    gpu_hours_lost_restart: float
    gpu_hours_lost_elastic: float


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    failures_per_month: float
    options: list[PlanOption]
    recommended: PlanOption | None
    reason: str


def make_plan(
    inputs: PlanInputs,
    ep_sizes: list[int],
    redundant_options: list[int],
    backup_options: list[bool],
    rng: np.random.Generator,
    near_best: float = 1.25,
    max_terms: int = 20_000,
) -> Plan:
    """Every (EP size, redundant experts, backup) option, and the one to take.

    Recommended: of the options whose expert slots leave `min_free_gb` per GPU and that lose
    at most `near_best` times the fewest GPU-hours a month under elastic recovery, the one with
    the least expert memory per GPU (memory left is KV cache, i.e. throughput); then backup on.
    """
    _validate(inputs, ep_sizes, redundant_options)
    failures = inputs.gpus * inputs.rate_per_gpu_hour * HOURS_PER_MONTH
    options = []
    for ep in ep_sizes:
        for redundant in redundant_options:
            loss_rank, loss_node = _loss_probabilities(inputs, ep, redundant, rng, max_terms)
            for backup in backup_options:
                options.append(_option(inputs, ep, redundant, backup, failures, loss_rank, loss_node))
    fitting = [o for o in options if o.fits]
    if not fitting:
        return Plan(inputs, failures, options, None, _nothing_fits(inputs, options))
    fewest = min(o.gpu_hours_lost_elastic for o in fitting)
    near = [o for o in fitting if o.gpu_hours_lost_elastic <= near_best * fewest]
    best = min(near, key=lambda o: (o.expert_gb_per_gpu, not o.backup, o.gpu_hours_lost_elastic))
    return Plan(inputs, failures, options, best, _reason(inputs, best, options, fewest, near_best))


def _validate(inputs: PlanInputs, ep_sizes: list[int], redundant_options: list[int]) -> None:
    if inputs.experts <= 0 or inputs.layers <= 0 or inputs.expert_mb <= 0:
        raise SimulationError("--experts, --layers and --expert-mb must be > 0")
    if not ep_sizes or not redundant_options:
        raise SimulationError("give at least one --ep-sizes and one --redundant value")
    for ep in ep_sizes:
        if not 0 < ep <= inputs.gpus:
            raise SimulationError(f"EP size {ep} must be between 1 and --gpus {inputs.gpus}")
    for redundant in redundant_options:
        if redundant < 0:
            raise SimulationError(f"--redundant {redundant} must be >= 0")
        for ep in ep_sizes:
            if redundant // inputs.experts + (1 if redundant % inputs.experts else 0) + 1 > ep:
                raise SimulationError(
                    f"{redundant} redundant experts put more replicas of an expert than EP{ep} has ranks"
                )


def _loss_probabilities(
    inputs: PlanInputs, ep: int, redundant: int, rng: np.random.Generator, max_terms: int
) -> tuple[float, float]:
    """P(some layer loses an expert) when one rank / one node of the group dies.

    Replicas of an expert go to distinct nodes, as the fault-aware placement puts them. Layers
    are placed independently at random, so given the dead set each layer keeps all its experts
    with the same probability q, and all L layers do with q**L.
    """
    slots = math.ceil((inputs.experts + redundant) / ep)
    per_node = min(inputs.gpus_per_node, ep)
    cfg = RandomConfig(f"EP{ep}", ep, slots, inputs.experts, redundant)
    max_replicas = 1 + math.ceil(redundant / inputs.experts)
    spread = per_node if max_replicas <= math.ceil(ep / per_node) else 1
    placement = random_placements(cfg, 1, rng, spread)[0]
    out = []
    for domains in (domain_map(ep), domain_map(ep, per_node)):
        sets = replica_domain_sets(placement, slots, domains)
        low, high = exact_loss_probability(sets, int(domains.max()) + 1, 1, max_terms)
        out.append(1 - (1 - (low + high) / 2) ** inputs.layers)
    return out[0], out[1]


def _option(
    inputs: PlanInputs,
    ep: int,
    redundant: int,
    backup: bool,
    failures: float,
    loss_rank: float,
    loss_node: float,
) -> PlanOption:
    slots = math.ceil((inputs.experts + redundant) / ep)
    expert_gb = slots * inputs.layers * inputs.expert_mb / MB_PER_GB
    nodes_per_group = max(1, ep // inputs.gpus_per_node)
    loss_failure = (1 - inputs.node_share) * loss_rank + inputs.node_share * loss_node
    reload_min = inputs.backup_reload_s / 60 if backup else inputs.disk_reload_min
    groups_gpus = (inputs.gpus // ep) * ep
    fleet_failures = failures * groups_gpus / inputs.gpus
    return PlanOption(
        ep_size=ep,
        redundant=redundant,
        backup=backup,
        slots_per_rank=slots,
        expert_gb_per_gpu=expert_gb,
        redundancy_gb_per_group=redundant * inputs.layers * inputs.expert_mb / MB_PER_GB,
        backup_gb_per_node=(
            inputs.experts * inputs.layers * inputs.expert_mb / MB_PER_GB / nodes_per_group if backup else 0.0
        ),
        fits=expert_gb + inputs.other_gb + inputs.min_free_gb <= inputs.gpu_mem_gb,
        loss_p_rank=loss_rank,
        loss_p_node=loss_node,
        loss_p_failure=loss_failure,
        gpu_hours_lost_restart=fleet_failures * ep * inputs.restart_min / 60,
        gpu_hours_lost_elastic=fleet_failures * ep * (inputs.pause_min + loss_failure * reload_min) / 60,
    )


def _reason(
    inputs: PlanInputs, best: PlanOption, options: list[PlanOption], fewest: float, near_best: float
) -> str:
    source = "the host-memory backup" if best.backup else "disk"
    text = (
        f"EP{best.ep_size} with {best.redundant} redundant experts and backup {'on' if best.backup else 'off'}: "
        f"it loses {best.gpu_hours_lost_elastic:.1f} GPU-hours a month with elastic recovery (against "
        f"{best.gpu_hours_lost_restart:.0f} with whole-group restarts), within {near_best:g}x of the fewest of the "
        f"options that fit ({fewest:.1f}), and of those its experts take the least memory, "
        f"{best.expert_gb_per_gpu:.1f} GB per GPU, leaving {inputs.gpu_mem_gb - inputs.other_gb - best.expert_gb_per_gpu:.1f} "
        f"GB for the KV cache; {best.loss_p_failure:.0%} of failures lose an expert, which comes back from {source}."
    )
    twice = [o for o in options if o.redundant >= inputs.experts]
    if twice:
        text += (
            f" Every expert twice costs {twice[0].redundancy_gb_per_group:.0f} GB more GPU memory per EP group;"
            f" the backup takes host memory instead ({best.backup_gb_per_node:.0f} GB per node here)."
        )
    return text


def _nothing_fits(inputs: PlanInputs, options: list[PlanOption]) -> str:
    least = min(options, key=lambda o: o.expert_gb_per_gpu)
    return (
        f"no option fits: the smallest takes {least.expert_gb_per_gpu:.1f} GB of experts per GPU (EP{least.ep_size}, "
        f"{least.redundant} redundant) + {inputs.other_gb:g} GB other + {inputs.min_free_gb:g} GB free > "
        f"{inputs.gpu_mem_gb:g} GB: use larger EP sizes, fewer redundant experts or GPUs with more memory"
    )
