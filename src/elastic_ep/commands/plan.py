"""`elastic-ep plan`: deployment options side by side (EP size, redundant experts, backup), the
one to take, and the `elastic-ep serve` command that runs it."""

from __future__ import annotations

import argparse

import numpy as np

from elastic_ep.commands.sim_options import (
    add_dataclass_options,
    add_output_arguments,
    add_rate_option,
    dataclass_from_options,
    int_list,
    write_plot,
)
from elastic_ep.sim.failure_rates import parse_rate
from elastic_ep.sim.planner import AUTO, Plan, PlanInputs, make_plan, survives_text
from elastic_ep.sim.report import dumps, format_table

PLAN_SKIP = ("rate_per_gpu_hour",)


def redundancy_list(text: str) -> list[int | str]:
    """`0,auto,256` -> [0, "auto", 256] (an argparse type)."""
    try:
        return [AUTO if x.strip() == AUTO else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of counts and {AUTO!r}, e.g. 0,{AUTO},256"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_options(parser, PlanInputs, skip=PLAN_SKIP)
    add_rate_option(parser)
    parser.add_argument("--ep-sizes", type=int_list, default=[32, 64, 128, 256], help="EP sizes to compare")
    parser.add_argument(
        "--redundant",
        type=redundancy_list,
        default=[0, AUTO, 256],
        help=f"redundant experts per layer to compare; {AUTO}: the fewest that outlive one rank, or the largest "
        "node when a group spans nodes (as `serve --redundant-experts auto`); a count that does not split evenly "
        "over an EP size is raised to the next one that does",
    )
    parser.add_argument(
        "--backup", choices=["on", "off", "both"], default="both", help="host-memory expert backup"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random placements")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    inputs = dataclass_from_options(PlanInputs, args, PLAN_SKIP, rate_per_gpu_hour=parse_rate(args.rate))
    backups = {"on": [True], "off": [False], "both": [False, True]}[args.backup]
    plan = make_plan(inputs, args.ep_sizes, args.redundant, backups, np.random.default_rng(args.seed))
    if args.json:
        print(dumps(plan))
    else:
        print(plan_text(plan))
    if args.plot:
        write_plot(args.plot, lambda ax: draw_plan(ax, plan, [str(r) for r in args.redundant], backups),
                   size_in=(11.0, 5.0), legend={"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1)})
    return 0


def plan_text(plan: Plan) -> str:
    inputs = plan.inputs
    lines = [
        f"{inputs.gpus} GPUs ({inputs.gpus_per_node} per node), {plan.failures_per_month:.0f} failures a month; "
        f"{inputs.experts} experts x {inputs.layers} layers x {inputs.expert_mb:g} MB; {inputs.gpu_mem_gb:g} GB per GPU"
    ]
    rows = [
        [
            f"EP{o.ep_size}",
            f"{o.redundant}{f' ({AUTO})' if AUTO in o.requested else ''}",
            "on" if o.backup else "off",
            str(o.slots_per_rank),
            f"{o.survives_rank_losses} / {o.survives_node_losses}",
            f"{o.expert_gb_per_gpu:.1f}",
            f"{o.redundancy_gb_per_group:.0f}",
            f"{o.backup_gb_per_node:.0f}",
            "yes" if o.fits else "no",
            f"{o.loss_p_rank:.0%} / {o.loss_p_node:.0%}",
            f"{o.gpu_hours_lost_restart:.0f}",
            f"{o.gpu_hours_lost_elastic:.1f}",
        ]
        for o in plan.options
    ]
    headers = [
        "EP", "redundant", "backup", "slots", "survives ranks/nodes", "expert GB/GPU", "extra GB/group",
        "backup GB/node", "fits", "P(loss) rank/node", "GPU-h/month restart", "GPU-h/month elastic",
    ]  # fmt: skip
    lines.append(format_table(headers, rows))
    lines.append(
        f"survives ranks/nodes: the dead ranks (largest nodes) after which the other ranks' slots still hold every "
        f"expert, so the group keeps serving. P(loss): the chance that one dead rank (node) held the last copy of "
        f"some expert in one of the {inputs.layers} layers; that expert is read back (host-memory backup or disk) "
        "during the recovery pause, so a group that survives a loss pauses longer but does not stop")
    lines += [f"note: {n}" for n in plan.notes]
    lines.append(f"\nrecommended: {plan.reason}")
    best = plan.recommended
    if best is not None:
        groups = inputs.gpus // best.ep_size
        lines.append(f"\nto run it (one EP group; {groups} such groups use {groups * best.ep_size} of the GPUs):")
        lines += [f"  {c}" for c in plan.commands]
        if len(plan.commands) > 1:
            lines.append("  (one agent per other node; NODEi_IP: each node's address, CONTROLLER_ADDR: the agent "
                         "address serve prints)")
    return "\n".join(lines)


def draw_plan(ax, plan: Plan, requests: list[str], backups: list[bool]) -> None:
    """GPU-hours lost a month by EP size: whole-group restart dashed, one line per (requested
    redundancy, backup) under elastic recovery, the recommendation starred. Lines drawn earlier
    are wider, so one that coincides with a later one still shows around it (an option that
    outlives no loss is the restart line: `save_plot` marks it so)."""
    restart = {o.ep_size: o.gpu_hours_lost_restart for o in plan.options}
    ax.plot(list(restart), list(restart.values()), "k--", label="whole-group restart")
    series = [(r, b) for r in requests for b in backups]
    for i, (request, backup) in enumerate(series):
        opts = sorted(
            (o for o in plan.options if request in o.requested and o.backup == backup), key=lambda o: o.ep_size
        )
        ax.plot(
            [o.ep_size for o in opts],
            [o.gpu_hours_lost_elastic for o in opts],
            marker="osD^v<>p"[i % 8],
            markersize=3 + 1.5 * (len(series) - i),
            linewidth=1 + 0.8 * (len(series) - i),
            linestyle="-" if backup else ":",
            alpha=0.8,
            label=f"elastic, {request} redundant, backup {'on' if backup else 'off'}",
        )
    best = plan.recommended
    if best is not None:
        ax.plot(
            [best.ep_size], [best.gpu_hours_lost_elastic], linestyle="none", marker="*", markersize=20,
            color="red", zorder=5,
            label=f"recommended: EP{best.ep_size}, {best.redundant} redundant, backup {'on' if best.backup else 'off'}",
        )  # fmt: skip
        ax.annotate(
            survives_text(best).removeprefix("it "), (best.ep_size, best.gpu_hours_lost_elastic),
            textcoords="offset points", xytext=(10, -14), fontsize=7, color="red",
        )  # fmt: skip
    ep_sizes = sorted(restart)
    ax.set_xscale("log", base=2)
    if all(o.gpu_hours_lost_elastic > 0 for o in plan.options):
        ax.set_yscale("log")
    ax.set_xticks(ep_sizes, [str(s) for s in ep_sizes])
    ax.set_xlabel("EP size")
    ax.set_ylabel("GPU-hours lost per month")
    ax.set_title(
        f"{plan.inputs.gpus} GPUs, {plan.failures_per_month:.0f} failures a month: GPU-hours lost by EP size"
    )
