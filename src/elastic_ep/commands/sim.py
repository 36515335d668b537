"""`elastic-ep sim`: blast radius, expert redundancy and fleet simulation (no torch imported)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from elastic_ep.commands.sim_options import (
    add_dataclass_options,
    add_output_arguments,
    add_rate_option,
    dataclass_from_options,
    int_list,
    write_plot,
)
from elastic_ep.commands.straggler_options import add_straggler_arguments, straggler_from_args
from elastic_ep.errors import SimulationError
from elastic_ep.sim import blast_radius as br
from elastic_ep.sim import fleet, redundancy
from elastic_ep.sim.assumptions import PAUSE_MIN, RESTART_MIN
from elastic_ep.sim.failure_rates import parse_rate
from elastic_ep.sim.fleet_report import FleetReport, Metric
from elastic_ep.sim.placements import read_placement_file
from elastic_ep.sim.report import dumps, format_table

FLEET_SKIP = ("class_shares", "rate_per_gpu_hour", "straggler_rule", "straggler_policy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)

    blast = sub.add_parser(
        "blast-radius",
        help="GPU-hours lost a month per EP group size, whole-group restart against elastic recovery",
        formatter_class=parser.formatter_class,
    )
    blast.add_argument("--gpus", type=int, default=2048, help="GPUs in the service (default 2048)")
    blast.add_argument("--group-sizes", type=int_list, default=[16, 64, 128, 256], help="EP group sizes")
    blast.add_argument(
        "--restart-min",
        type=float,
        default=RESTART_MIN,
        help=f"whole-group restart, minutes (default {RESTART_MIN:g})",
    )
    blast.add_argument(
        "--pause-min",
        type=float,
        default=PAUSE_MIN,
        help=f"elastic recovery pause, minutes (default {PAUSE_MIN:g})",
    )
    add_rate_option(blast)
    add_output_arguments(blast)

    red = sub.add_parser(
        "redundancy",
        help="chance that k dead ranks or nodes lose an expert",
        formatter_class=parser.formatter_class,
    )
    red.add_argument(
        "--placement", metavar="FILE", help="placement JSON (phy2log) written by `elastic-ep eplb`"
    )
    red.add_argument(
        "--ranks", type=int, help="EP ranks of a random placement (without it: EP32 x 9 slots, EP320 x 1 slot and "
                                  "EP64 x 8 slots with every expert twice, on 256 experts)"
    )
    red.add_argument("--slots", type=int, help="expert slots per rank")
    red.add_argument("--experts", type=int, default=256, help="logical experts per layer (default 256)")
    red.add_argument(
        "--redundant", type=int, help="extra copies, hottest experts first (default: fill every slot)"
    )
    red.add_argument(
        "--k", type=int_list, default=[1, 2, 4], help="dead ranks (or nodes) to try (default 1,2,4)"
    )
    red.add_argument(
        "--method", choices=["monte-carlo", "exact", "both"], default="both", help="how to estimate the loss"
    )
    red.add_argument("--trials", type=int, default=4000, help="Monte Carlo draws per k (default 4000)")
    red.add_argument(
        "--placements", type=int, default=1, help="random placements to average over (default 1)"
    )
    red.add_argument("--seed", type=int, default=0, help="seed of the random placements and draws")
    red.add_argument(
        "--ranks-per-node", type=int, help="whole-node failures: k counts nodes of this many ranks"
    )
    red.add_argument(
        "--node-map", metavar="FILE", help="whole-node failures: JSON list, the node of each rank"
    )
    red.add_argument(
        "--spread",
        choices=["rank", "node"],
        default="rank",
        help="random placements keep replicas on distinct ...",
    )
    red.add_argument(
        "--max-terms",
        type=int,
        default=redundancy.MAX_TERMS,
        help="exact mode: inclusion-exclusion terms before falling back to bounds",
    )
    add_output_arguments(red)

    fl = sub.add_parser(
        "fleet",
        help="discrete-event simulation of a fleet: restart against elastic recovery",
        formatter_class=parser.formatter_class,
    )
    add_dataclass_options(fl, fleet.FleetConfig, skip=FLEET_SKIP)
    add_straggler_arguments(fl)
    add_rate_option(fl)
    fl.add_argument(
        "--replications", type=int, default=10, help="independent runs for the 95%% intervals (default 10)"
    )
    fl.add_argument("--seed", type=int, default=0, help="seed of the failure traces")
    usable_cores = len(os.sched_getaffinity(0))
    fl.add_argument(
        "--jobs",
        type=int,
        default=usable_cores,
        help=f"processes that run the replications and policies (default: the usable cores, {usable_cores} "
             "here); 1 runs them in this process; the numbers are the same for any --jobs",
    )
    add_output_arguments(fl)


def run(args: argparse.Namespace) -> int:
    return {"blast-radius": run_blast_radius, "redundancy": run_redundancy, "fleet": run_fleet}[args.what](
        args
    )


def run_blast_radius(args: argparse.Namespace) -> int:
    report = br.blast_radius(
        args.gpus, args.group_sizes, parse_rate(args.rate), args.restart_min, args.pause_min
    )
    if args.json:
        print(dumps(report))
    else:
        print(
            f"failure rate {report.rate_per_gpu_hour:.2e} per GPU-hour; {report.total_gpus} GPUs fail about "
            f"{report.failures_per_month:.0f} times a month, however they are grouped"
        )
        print(
            f"GPU-hours lost a month: whole-group restart ({args.restart_min:g} min) / elastic ({args.pause_min:g} min)"
        )
        rows = [
            [
                str(r.group_size),
                str(r.groups),
                f"{r.mtbf_days:.1f}",
                f"{r.gpu_hours_lost_restart:.0f} / {r.gpu_hours_lost_elastic:.0f}",
            ]
            for r in report.rows
        ]
        print(
            format_table(["EP group", "groups", "group MTBF (days)", "GPU-h lost: restart / elastic"], rows)
        )
    if args.plot:

        def draw(ax):
            sizes = [r.group_size for r in report.rows]
            ax.plot(
                sizes,
                [r.gpu_hours_lost_restart for r in report.rows],
                "o-",
                label=f"restart ({args.restart_min:g} min)",
            )
            ax.plot(
                sizes,
                [r.gpu_hours_lost_elastic for r in report.rows],
                "s-",
                label=f"elastic ({args.pause_min:g} min)",
            )
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.set_xlabel("EP group size (GPUs)")
            ax.set_ylabel("GPU-hours lost per month")
            ax.set_title(f"{report.total_gpus} GPUs, {report.failures_per_month:.0f} failures a month")

        write_plot(args.plot, draw)
    return 0


def _redundancy_cases(
    args: argparse.Namespace, rng: np.random.Generator
) -> list[tuple[str, list[np.ndarray], int, np.ndarray]]:
    """(name, placements [L, n_slots] each, slots per rank, rank->domain map) to analyse."""
    node_of_rank = _read_node_map(args.node_map) if args.node_map else None
    if args.placement:
        if args.ranks is not None:
            raise SimulationError("give either --placement or --ranks, not both")
        phy2log, ranks, slots = read_placement_file(args.placement, args.slots)
        domains = redundancy.domain_map(ranks, args.ranks_per_node, node_of_rank)
        name = Path(args.placement).name + (f" ({len(phy2log)} layers)" if len(phy2log) > 1 else "")
        return [(name, [phy2log], slots, domains)]
    if args.ranks is None:
        if args.slots is not None or args.redundant is not None:
            raise SimulationError("--slots and --redundant describe a configuration: give --ranks too")
        configs = list(redundancy.SEED_001_CONFIGS)
    else:
        if args.slots is None:
            raise SimulationError("--ranks needs --slots (expert slots per rank)")
        redundant = (
            max(0, args.ranks * args.slots - args.experts) if args.redundant is None else args.redundant
        )
        name = f"EP{args.ranks} x {args.slots} slots, {redundant} redundant"
        configs = [redundancy.RandomConfig(name, args.ranks, args.slots, args.experts, redundant)]
    cases = []
    for cfg in configs:
        domains = redundancy.domain_map(cfg.ranks, args.ranks_per_node, node_of_rank)
        per_domain = 1 if args.spread == "rank" else _ranks_per_domain(domains)
        placements = redundancy.random_placements(cfg, args.placements, rng, per_domain)
        cases.append((cfg.name, placements, cfg.slots_per_rank, domains))
    return cases


def _ranks_per_domain(domains: np.ndarray) -> int:
    sizes = np.bincount(domains)
    if (sizes != sizes[0]).any() or (domains != np.arange(len(domains)) // sizes[0]).any():
        raise SimulationError(
            "--spread node needs nodes of consecutive ranks of one size: use --ranks-per-node"
        )
    return int(sizes[0])


def _read_node_map(path: str) -> list[int]:
    try:
        nodes = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SimulationError(f"--node-map {path} is not a readable JSON list of node ids ({e})") from None
    if not isinstance(nodes, list) or not all(isinstance(n, int | str) for n in nodes):
        raise SimulationError(f"--node-map {path} must be a JSON list with the node of each rank")
    return nodes


def run_redundancy(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    methods = ["monte-carlo", "exact"] if args.method == "both" else [args.method]
    unit = "ranks" if args.ranks_per_node is None and args.node_map is None else "nodes"
    results = []
    for name, placements, slots, domains in _redundancy_cases(args, rng):
        by_method = {
            m: redundancy.analyse(placements, slots, domains, args.k, m, args.trials, rng, args.max_terms)
            for m in methods
        }
        results.append({"name": name, "dead_unit": unit, "estimates": by_method})
    if args.json:
        print(dumps(results))
    else:
        print(f"k dead {unit}: chance that some expert loses every replica, and the mean number lost")
        rows = []
        for res in results:
            for i, k in enumerate(args.k):
                row = [res["name"], str(k)]
                for m in methods:
                    row += _estimate_cells(res["estimates"][m][i])
                rows.append(row)
        headers = ["configuration", "k"]
        for m in methods:
            headers += [f"P(loss) {m}", f"lost {m}"]
        print(format_table(headers, rows))
    if args.plot:

        def draw(ax):
            for res in results:
                est = res["estimates"][methods[-1]]
                ax.plot(args.k, [e.p_loss * 100 for e in est], "o-", label=res["name"])
            ax.set_xticks(args.k)
            ax.set_xlabel(f"dead {unit} (k)")
            ax.set_ylabel("P(some expert lost) %")
            ax.set_ylim(-2, 102)

        write_plot(args.plot, draw, legend={"fontsize": 8})
    return 0


def _estimate_cells(e: redundancy.LossEstimate) -> list[str]:
    if e.method == "monte-carlo":
        return [
            f"{e.p_loss:.1%} [{e.p_low:.1%}, {e.p_high:.1%}]",
            f"{e.lost_mean:.2f} ±{e.lost_high - e.lost_mean:.2f}",
        ]
    if e.method == "exact":
        return [f"{e.p_loss:.1%}", f"{e.lost_mean:.2f}"]
    return [f"{e.p_low:.1%} .. {e.p_high:.1%}", f"{e.lost_mean:.2f}"]


def run_fleet(args: argparse.Namespace) -> int:
    rule, policy = straggler_from_args(args)  # a bad value is an ElasticEPError naming the flag
    cfg = dataclass_from_options(fleet.FleetConfig, args, FLEET_SKIP, rate_per_gpu_hour=parse_rate(args.rate),
                                 straggler_rule=rule, straggler_policy=policy)
    report = fleet.simulate_fleet(cfg, args.replications, args.seed, args.jobs)
    if args.json:
        print(dumps(report))
    else:
        print(_fleet_text(report))
    if args.plot:

        def draw(ax):
            total = cfg.groups * cfg.ep_size
            for run_result in report.example_runs:
                ends = np.append(run_result.capacity_t[1:], cfg.hours)
                lost = np.cumsum((1 - run_result.capacity) * total * (ends - run_result.capacity_t))
                ax.plot(np.append(0, ends) / 24, np.append(0, lost), label=run_result.policy)
            ax.set_xlabel("day")
            ax.set_ylabel("GPU-hours lost so far")
            ax.set_title(f"{total} GPUs in EP{cfg.ep_size} groups (replication 1 of {report.replications})")

        write_plot(args.plot, draw)
    return 0


def _fleet_text(report: FleetReport) -> str:
    cfg = report.config
    interval = (
        "mean ± 95% interval"
        if report.replications > 1
        else "one replication gives no interval (n/a): give --replications 2 or more for one"
    )
    head = (
        f"{cfg.groups} EP{cfg.ep_size} groups ({cfg.groups * cfg.ep_size} GPUs, {cfg.spare_gpus} spares), "
        f"{cfg.days:g} days, {report.replications} replications; failures {_pm(report.failures, 0)}; {interval}"
    )

    def row(label: str, pick, digits: int = 0, scale: float = 1.0) -> list[str]:
        return [label] + [_pm(pick(p), digits, scale) for p in report.policies]

    rows = [
        row("GPU-hours lost", lambda p: p.gpu_hours_lost),
        row("  group stopped", lambda p: p.stopped_gpu_h),
        row("  ranks missing", lambda p: p.degraded_gpu_h),
        row("  stragglers", lambda p: p.slow_gpu_h),
        row("availability %", lambda p: p.availability, 4, 100),
        row("goodput %", lambda p: p.goodput, 4, 100),
        row("expert-loss events", lambda p: p.expert_loss_events, 1),
        row("straggler evictions", lambda p: p.evictions, 1),
    ]
    rows += [
        row(f"capacity {q} %", lambda p, q=q: p.capacity_quantiles[q], 2, 100) for q in ("p1", "p5", "p50")
    ]
    rows.append(row("capacity min %", lambda p: p.capacity_min, 2, 100))
    assumed = (
        f"assumed: restart {cfg.restart_min:g} min, pause {cfg.pause_min:g} min, expert reload {cfg.disk_reload_min:g} "
        f"min from disk / {cfg.backup_reload_s:g} s from backup, repair {cfg.gpu_repair_h:g} h (GPU) / "
        f"{cfg.node_repair_h:g} h (node); stragglers {cfg.straggler_rate_per_gpu_hour:.2e}/GPU-h at "
        f"{cfg.straggler_speed:.0%} speed for {cfg.straggler_h:g} h\n"
        f"straggler policy of the elastic policies (restart does not see stragglers): {report.straggler_policy}"
    )
    return head + "\n" + assumed + "\n" + format_table(["metric"] + [p.policy for p in report.policies], rows)


def _pm(metric: Metric, digits: int, scale: float = 1.0) -> str:
    half = "n/a" if metric.half_width is None else f"{metric.half_width * scale:.{digits}f}"
    return f"{metric.mean * scale:.{digits}f} ±{half}"
