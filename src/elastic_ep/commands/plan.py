"""`elastic-ep plan`: deployment options side by side (EP size, redundant experts, backup)."""

from __future__ import annotations

import argparse

import numpy as np

from elastic_ep.commands.sim import (
    add_dataclass_options,
    add_output_arguments,
    add_rate_option,
    dataclass_from_options,
    int_list,
)
from elastic_ep.sim.failure_rates import parse_rate
from elastic_ep.sim.planner import PlanInputs, make_plan
from elastic_ep.sim.report import dumps, format_table, save_plot

PLAN_SKIP = ("rate_per_gpu_hour",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_options(parser, PlanInputs, skip=PLAN_SKIP)
    add_rate_option(parser)
    parser.add_argument("--ep-sizes", type=int_list, default=[32, 64, 128, 256], help="EP sizes to compare")
    parser.add_argument(
        "--redundant", type=int_list, default=[0, 32, 256], help="redundant experts per layer to compare"
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
        print(
            f"{inputs.gpus} GPUs, {plan.failures_per_month:.0f} failures a month; {inputs.experts} experts x "
            f"{inputs.layers} layers x {inputs.expert_mb:g} MB; {inputs.gpu_mem_gb:g} GB per GPU"
        )
        rows = [
            [
                f"EP{o.ep_size}",
                str(o.redundant),
                "on" if o.backup else "off",
                str(o.slots_per_rank),
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
            "EP", "redundant", "backup", "slots", "expert GB/GPU", "extra GB/group", "backup GB/node", "fits",
            "P(loss) rank/node", "GPU-h/month restart", "GPU-h/month elastic",
        ]  # fmt: skip
        print(format_table(headers, rows))
        print(f"\nrecommended: {plan.reason}")
    if args.plot:

        def draw(ax):
            for marker, redundant in zip("osD^v<>", args.redundant, strict=False):
                for backup in backups:
                    opts = [o for o in plan.options if o.redundant == redundant and o.backup == backup]
                    label = f"elastic, {redundant} redundant, backup {'on' if backup else 'off'}"
                    xs, ys = [o.ep_size for o in opts], [o.gpu_hours_lost_elastic for o in opts]
                    ax.plot(xs, ys, marker=marker, linestyle="-" if backup else ":", label=label)
            restart = [o for o in plan.options if o.redundant == args.redundant[0] and o.backup == backups[0]]
            ax.plot(
                [o.ep_size for o in restart],
                [o.gpu_hours_lost_restart for o in restart],
                "k--",
                label="restart",
            )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(args.ep_sizes, [str(s) for s in args.ep_sizes])
            ax.set_xlabel("EP size")
            ax.set_ylabel("GPU-hours lost per month")
            ax.legend(fontsize=7)

        save_plot(args.plot, draw)
    return 0
