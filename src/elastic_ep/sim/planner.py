"""The deployment planner: EP size, redundant experts and backup, side by side.

Only configurations `elastic-ep serve` accepts are listed: experts + redundant slots divide
evenly over the EP size (a requested count that does not is raised to the next one that does,
with a note), and `auto` is the fewest count that outlives one rank or the largest node
(`placement.choose_redundant_experts`, what `serve` uses).

For each option: the GPU memory its expert slots take, the losses it outlives, the chance that
a failure loses an expert (in any layer; random per-layer placements with replicas on distinct
ranks), and the GPU-hours lost a month, whole-group restart against elastic recovery (pause
plus reloading lost experts from the host-memory backup or from disk; a failure the option does
not outlive stops the group for a restart). Then the option to take, why, and the commands
that run it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from elastic_ep.errors import SimulationError
from elastic_ep.placement.redundancy import choose_redundant_experts, losses_survived
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
BYTES_PER_MB = 1_000_000
AUTO = "auto"


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
    """One option. `requested`: the `--redundant` values that gave this count (`auto` among them
    when it is the fewest that outlives one rank or node loss). `survives_rank_losses` /
    `survives_node_losses`: dead ranks / largest nodes after which the group still holds every
    expert. `loss_p_rank`/`loss_p_node`: chance that one dead rank / one dead node loses some
    expert in some layer; `loss_p_failure` mixes them by the failure cause mix."""

    ep_size: int
    redundant: int
    requested: tuple[str, ...]
    backup: bool
    slots_per_rank: int
    survives_rank_losses: int
    survives_node_losses: int
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
    """Every option; the recommended one, why, and the commands that run one EP group of it;
    `notes`: requested counts that serve would refuse, and what was listed instead."""

    inputs: PlanInputs
    failures_per_month: float
    options: list[PlanOption]
    recommended: PlanOption | None
    reason: str
    commands: list[str]
    notes: list[str]


def make_plan(
    inputs: PlanInputs,
    ep_sizes: list[int],
    redundant_options: list[int | str],
    backup_options: list[bool],
    rng: np.random.Generator,
    near_best: float = 1.25,
    max_terms: int = 20_000,
) -> Plan:
    """Every (EP size, redundant experts, backup) option, and the one to take.

    redundant_options: counts of redundant experts per layer, or AUTO (the fewest that outlive
    one rank, or the largest node when a group spans nodes of `gpus_per_node`).
    Recommended: of the options whose expert slots leave `min_free_gb` per GPU and that lose
    at most `near_best` times the fewest GPU-hours a month under elastic recovery, the one with
    the least expert memory per GPU (memory left is KV cache, i.e. throughput); then backup on.
    """
    _validate(inputs, ep_sizes, redundant_options)
    failures = inputs.gpus * inputs.rate_per_gpu_hour * HOURS_PER_MONTH
    options, notes = [], []
    for ep in ep_sizes:
        counts, ep_notes = _serve_counts(inputs, ep, redundant_options)
        notes += ep_notes
        for redundant, requested in counts.items():
            loss_rank, loss_node = _loss_probabilities(inputs, ep, redundant, rng, max_terms)
            for backup in backup_options:
                options.append(
                    _option(inputs, ep, redundant, requested, backup, failures, loss_rank, loss_node)
                )
    fitting = [o for o in options if o.fits]
    if not fitting:
        return Plan(inputs, failures, options, None, _nothing_fits(inputs, options), [], notes)
    fewest = min(o.gpu_hours_lost_elastic for o in fitting)
    near = [o for o in fitting if o.gpu_hours_lost_elastic <= near_best * fewest]
    best = min(near, key=lambda o: (o.expert_gb_per_gpu, not o.backup, o.gpu_hours_lost_elastic))
    reason = _reason(inputs, best, options, fewest, near_best)
    return Plan(inputs, failures, options, best, reason, serve_commands(inputs, best), notes)


def _validate(inputs: PlanInputs, ep_sizes: list[int], redundant_options: list[int | str]) -> None:
    for name in ("gpus", "gpus_per_node"):
        if getattr(inputs, name) <= 0:
            raise SimulationError(f"--{name.replace('_', '-')} {getattr(inputs, name)} must be > 0")
    for name in ("experts", "layers", "expert_mb", "gpu_mem_gb"):
        value = getattr(inputs, name)
        if not 0 < value < math.inf:
            raise SimulationError(f"--{name.replace('_', '-')} {value} must be a number > 0")
    for name in ("other_gb", "min_free_gb", "restart_min", "pause_min", "disk_reload_min", "backup_reload_s"):
        value = getattr(inputs, name)
        if not 0 <= value < math.inf:
            raise SimulationError(f"--{name.replace('_', '-')} {value} must be a number >= 0")
    if not 0 <= inputs.node_share <= 1:
        raise SimulationError(f"--node-share {inputs.node_share} must be between 0 and 1 (a share of failures)")
    if not ep_sizes or not redundant_options:
        raise SimulationError("give at least one --ep-sizes and one --redundant value")
    for ep in ep_sizes:
        if not 0 < ep <= inputs.gpus:
            raise SimulationError(f"EP size {ep} must be between 1 and --gpus {inputs.gpus}")
    for redundant in redundant_options:
        if redundant != AUTO and (not isinstance(redundant, int) or redundant < 0):
            raise SimulationError(f"--redundant {redundant} must be a count >= 0 or {AUTO}")


def _serve_counts(
    inputs: PlanInputs, ep: int, redundant_options: list[int | str]
) -> tuple[dict[int, tuple[str, ...]], list[str]]:
    """For one EP size: {count serve accepts: the requests that gave it}, ascending, and a note for
    each request raised to the next count that divides evenly over `ep` ranks."""
    by_count: dict[int, tuple[str, ...]] = {}
    notes = []
    for request in redundant_options:
        if request == AUTO:
            count = _auto_choice(inputs, ep).redundant_experts
        else:
            count = -(-(inputs.experts + request) // ep) * ep - inputs.experts
            if count != request:
                notes.append(
                    f"EP{ep}: {inputs.experts} experts + {request} redundant do not split evenly over {ep} ranks "
                    f"(serve refuses it); listed {count} redundant instead, the next count that does"
                )
        if (inputs.experts + count) // ep > inputs.experts:
            raise SimulationError(
                f"{count} redundant experts put more replicas of an expert than EP{ep} has ranks; "
                "give fewer --redundant"
            )
        by_count[count] = by_count.get(count, ()) + (str(request),)
    return dict(sorted(by_count.items())), notes


def _auto_choice(inputs: PlanInputs, ep: int):
    return choose_redundant_experts(
        inputs.experts, ep, inputs.layers, round(inputs.expert_mb * BYTES_PER_MB), ranks_per_node=inputs.gpus_per_node
    )


def _loss_probabilities(
    inputs: PlanInputs, ep: int, redundant: int, rng: np.random.Generator, max_terms: int
) -> tuple[float, float]:
    """P(some layer loses an expert) when one rank / one node of the group dies.

    Replicas of an expert go to distinct nodes, as the fault-aware placement puts them. Layers
    are placed independently at random, so given the dead set each layer keeps all its experts
    with the same probability q, and all L layers do with q**L.
    """
    slots = (inputs.experts + redundant) // ep
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
    requested: tuple[str, ...],
    backup: bool,
    failures: float,
    loss_rank: float,
    loss_node: float,
) -> PlanOption:
    slots = (inputs.experts + redundant) // ep
    survives = losses_survived(inputs.experts, ep, redundant, ranks_per_node=inputs.gpus_per_node)
    expert_gb = slots * inputs.layers * inputs.expert_mb / MB_PER_GB
    nodes_per_group = max(1, ep // inputs.gpus_per_node)
    loss_failure = (1 - inputs.node_share) * loss_rank + inputs.node_share * loss_node
    reload_min = inputs.backup_reload_s / 60 if backup else inputs.disk_reload_min
    # A loss the group does not outlive stops it until the lost ranks come back.
    rank_min = inputs.pause_min + loss_rank * reload_min if survives.rank_losses else inputs.restart_min
    node_min = inputs.pause_min + loss_node * reload_min if survives.node_losses else inputs.restart_min
    elastic_min = (1 - inputs.node_share) * rank_min + inputs.node_share * node_min
    groups_gpus = (inputs.gpus // ep) * ep
    fleet_failures = failures * groups_gpus / inputs.gpus
    return PlanOption(
        ep_size=ep,
        redundant=redundant,
        requested=requested,
        backup=backup,
        slots_per_rank=slots,
        survives_rank_losses=survives.rank_losses,
        survives_node_losses=survives.node_losses,
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
        gpu_hours_lost_elastic=fleet_failures * ep * elastic_min / 60,
    )


def serve_commands(inputs: PlanInputs, option: PlanOption) -> list[str]:
    """The commands that run one EP group of `option`: `elastic-ep serve` on the first node, and
    `elastic-ep agent` on each other node of `gpus_per_node` GPUs (placeholders in capitals:
    the checkpoint, each node's address, the controller's agent address serve prints)."""
    first = min(option.ep_size, inputs.gpus_per_node)
    serve = (
        f"elastic-ep serve --model CHECKPOINT_DIR --ep-size {option.ep_size} --redundant-experts {option.redundant} "
        f"--{'' if option.backup else 'no-'}expert-backup"
    )
    if first == option.ep_size:
        return [serve]
    full, rest = divmod(option.ep_size - first, inputs.gpus_per_node)
    agents = [inputs.gpus_per_node] * full + ([rest] if rest else [])
    # Across hosts every process binds and advertises its own host's address, not 127.0.0.1, and
    # holds the deployment's cluster key (serve writes the file, a copy goes to every host).
    return [f"{serve} --local-ranks {first} --host NODE0_IP --cluster-key-file CLUSTER_KEY"] + [
        f"elastic-ep agent --controller CONTROLLER_ADDR --node node{i} --ranks {ranks} --advertise-host NODE{i}_IP "
        "--cluster-key-file CLUSTER_KEY"
        for i, ranks in enumerate(agents, start=1)
    ]


def _reason(
    inputs: PlanInputs, best: PlanOption, options: list[PlanOption], fewest: float, near_best: float
) -> str:
    source = "the host-memory backup" if best.backup else "disk"
    text = (
        f"EP{best.ep_size} with {best.redundant} redundant experts and backup {'on' if best.backup else 'off'}: "
        f"it loses {best.gpu_hours_lost_elastic:.1f} GPU-hours a month with elastic recovery (against "
        f"{best.gpu_hours_lost_restart:.0f} with whole-group restarts), within {near_best:g}x of the fewest of the "
        f"options that fit ({fewest:.1f}), and of those its experts take the least memory, "
        f"{best.expert_gb_per_gpu:.1f} GB per GPU, "
        f"leaving {inputs.gpu_mem_gb - inputs.other_gb - best.expert_gb_per_gpu:.1f} "
        f"GB for the KV cache; {survives_text(best)}; {best.loss_p_failure:.0%} of failures lose an expert, which "
        f"comes back from {source}."
    )
    if any(o.redundant >= inputs.experts for o in options):
        text += (
            f" Every expert twice costs {inputs.experts * inputs.layers * inputs.expert_mb / MB_PER_GB:.0f} GB more "
            "GPU memory per EP group;"
            f" the backup takes host memory instead ({best.backup_gb_per_node:.0f} GB per node here)."
        )
    return text


def survives_text(option: PlanOption) -> str:
    """What the option outlives, in words."""
    if not option.survives_rank_losses:
        return "it does not outlive the loss of a rank: every failure stops it for a restart"
    nodes = option.survives_node_losses
    node_text = {0: "", 1: " or its largest node"}.get(nodes, f" or its {nodes} largest nodes")
    ranks = option.survives_rank_losses
    return f"it keeps serving after losing any {ranks} rank{'s' if ranks > 1 else ''}{node_text}"


def _nothing_fits(inputs: PlanInputs, options: list[PlanOption]) -> str:
    least = min(options, key=lambda o: o.expert_gb_per_gpu)
    return (
        f"no option fits: the smallest takes {least.expert_gb_per_gpu:.1f} GB of experts per GPU (EP{least.ep_size}, "
        f"{least.redundant} redundant) + {inputs.other_gb:g} GB other + {inputs.min_free_gb:g} GB free > "
        f"{inputs.gpu_mem_gb:g} GB: use larger EP sizes, fewer redundant experts or GPUs with more memory"
    )
