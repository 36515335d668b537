"""Options shared by `elastic-ep sim` and `elastic-ep plan`: one option per field of an inputs
dataclass (named and defaulted after the field, with its help), failure rates, output formats."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from elastic_ep.sim.report import save_plot


def int_list(text: str) -> list[int]:
    """`16,64,128` -> [16, 64, 128] (an argparse type)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


OPTION_HELP = {
    "gpus": "GPUs in the service",
    "days": "simulated days",
    "gpus_per_node": "GPUs per node (a node failure takes them all)",
    "ep_size": "ranks per EP group",
    "experts": "routed experts per layer",
    "slots_per_rank": "expert slots per rank",
    "gpu_repair_h": "hours to repair a failed GPU",
    "node_repair_h": "hours to repair a failed node",
    "software_restart_min": "minutes for a crashed rank's process to restart and rejoin",
    "spare_fraction": "spare GPUs, as a fraction of --gpus",
    "restart_min": "whole-group restart, minutes",
    "pause_min": "elastic recovery pause, minutes",
    "join_min": "minutes for a spare GPU to load weights and join a group",
    "disk_reload_min": "minutes to reload lost experts from disk",
    "backup_reload_s": "seconds to reload lost experts from the host-memory backup",
    "straggler_rate_per_gpu_hour": "stragglers per GPU-hour",
    "straggler_speed": "speed of a group slowed by a straggler, fraction of normal",
    "straggler_h": "hours a straggler stays slow when nobody evicts it",
    "attention_share": "share of a rank's step that is attention (its own DP requests), which a derate cannot "
                       "move to other ranks",
    "layers": "MoE layers",
    "expert_mb": "MB of one expert's weights in one layer (DeepSeek-V3 FP8: 44)",
    "gpu_mem_gb": "GB of memory per GPU",
    "other_gb": "GB per GPU for everything but routed experts (dense weights, activations, buffers)",
    "min_free_gb": "GB per GPU an option must leave free for the KV cache",
    "node_share": "share of failures that take a whole node, by default the Llama 3 counts'",
}


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...]) -> None:
    """One option per field of dataclass `cls` but `skip`, named and defaulted after the field."""
    defaults = cls()
    for f in fields(cls):
        if f.name in skip:
            continue
        value = getattr(defaults, f.name)
        parser.add_argument(
            "--" + f.name.replace("_per_gpu_hour", "").replace("_", "-"),
            dest=f.name,
            type=type(value),
            default=value,
            help=f"{OPTION_HELP[f.name]} (default {value:g})",
        )


def dataclass_from_options(cls: type, args: argparse.Namespace, skip: tuple[str, ...], **given):
    """The dataclass `cls` from the options `add_dataclass_options` made, plus `given` fields."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if f.name not in skip}, **given)


def add_rate_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rate", default="FROM_DATA", help="failures per GPU-hour, or FROM_DATA (Llama 3 counts)"
    )


def write_plot(path: str, draw: Callable[[Any], None], **kwargs: Any) -> None:
    """`--plot FILE`: draw it (sim/report.py `save_plot`) and say where it went, on stderr so
    that `--json` output stays JSON."""
    save_plot(path, draw, **kwargs)
    print(f"wrote the plot to {Path(path).resolve()}", file=sys.stderr)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw a figure into FILE.png")
