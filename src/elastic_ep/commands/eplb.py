"""`elastic-ep eplb`: compute an expert placement from a load file and summarize its measures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from elastic_ep.errors import PlacementError
from elastic_ep.placement import (
    ExpertLocation,
    balancedness,
    copies_on_same_rank,
    experts_without_live_replica,
    fault_aware_placement,
    rebalance_experts,
    replicas_sharing_node,
    slots_moved,
)
from elastic_ep.placement.fault_aware import DEFAULT_MOVEMENT_TOLERANCE

POLICIES = ("fault-aware", "hierarchical", "global")
LOAD_KEYS = ("load", "weight", "logical_count")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, metavar="FILE",
                        help="tokens per (layer, expert): .json, .npy or .pt holding [L, E] "
                             "(or [steps, L, E], summed over steps)")
    parser.add_argument("--ranks", type=int, required=True, metavar="N", help="EP ranks, dead ones included")
    parser.add_argument("--slots", type=int, required=True, metavar="S", help="expert slots per rank and layer")
    parser.add_argument("--nodes", type=int, default=1, metavar="K",
                        help="nodes (failure domains); ranks fill nodes in order, N / K each (default 1)")
    parser.add_argument("--policy", choices=POLICIES, default="fault-aware", help="default fault-aware")
    parser.add_argument("--groups", type=int, default=None, metavar="G",
                        help="expert groups for the hierarchical policy (default: one per node)")
    parser.add_argument("--dead", default="", metavar="3,7", help="comma-separated dead ranks")
    parser.add_argument("--speeds", default="", metavar="3=0.5,7=0.8",
                        help="relative speed of slow ranks (fault-aware; default 1.0 each)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_MOVEMENT_TOLERANCE,
                        help=f"fault-aware movement tolerance (default {DEFAULT_MOVEMENT_TOLERANCE})")
    parser.add_argument("--from", dest="current", metavar="PLACEMENT.json",
                        help="the placement in use: fault-aware keeps it where it can; slots moved are reported")
    parser.add_argument("--out", metavar="PLACEMENT.json", help="write the placement here")
    parser.add_argument("--json", action="store_true", help="print the summary and the placement as JSON")


def run(args: argparse.Namespace) -> int:
    load = read_load(Path(args.load))
    _check_tokens(load, args.load)
    if args.ranks < 1 or args.slots < 1 or args.nodes < 1:
        raise PlacementError("--ranks, --slots and --nodes must be at least 1")
    if args.ranks % args.nodes:
        raise PlacementError(f"--ranks {args.ranks} does not split evenly over --nodes {args.nodes}")
    if args.groups is not None and args.groups < 1:
        raise PlacementError(f"--groups {args.groups} must be at least 1")
    if not args.tolerance >= 0:
        raise PlacementError(f"--tolerance {args.tolerance} must be >= 0 (a fraction of the ideal time)")
    if args.out and not Path(args.out).parent.is_dir():
        raise PlacementError(f"--out {args.out}: folder {Path(args.out).parent} does not exist")
    dead = _parse_ranks(args.dead, args.ranks)
    live = [r for r in range(args.ranks) if r not in dead]
    rank_nodes = {r: r // (args.ranks // args.nodes) for r in range(args.ranks)}
    current = ExpertLocation.load(args.current) if args.current else None
    if args.policy == "fault-aware":
        location = fault_aware_placement(
            load, live, rank_nodes, _parse_speeds(args.speeds, args.ranks), args.slots, args.ranks,
            current=current, movement_tolerance=args.tolerance,
        )
    else:
        location = _deepseek(load, args, live, rank_nodes)
    summary = _summary(args, location, load, live, rank_nodes, current)
    if args.out:
        location.save(args.out)
    if args.json:
        print(json.dumps({**summary, "placement": json.loads(location.to_json())}))
    else:
        _print_summary(summary, args.out)
    return 0


def read_load(path: Path) -> np.ndarray:
    """[L, E] float64 from a .json, .npy or .pt file; PlacementError naming what is wrong."""
    if not path.is_file():
        raise PlacementError(f"load file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(path.read_text())
        elif suffix == ".npy":
            data = np.load(path, allow_pickle=False)
        elif suffix == ".pt":
            import torch

            data = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise PlacementError(f"load file {path} must end in .json, .npy or .pt")
        if isinstance(data, dict):
            key = next((k for k in LOAD_KEYS if k in data), None)
            if key is None:
                raise PlacementError(f"load file {path} is a mapping without any of the keys {list(LOAD_KEYS)}")
            data = data[key]
        load = np.asarray(data, dtype=np.float64)
    except PlacementError:
        raise
    except Exception as e:  # any parser's failure is the user's file, reported without a traceback
        raise PlacementError(f"cannot read load file {path}: {e}") from e
    if load.ndim == 3:
        load = load.sum(axis=0)
    if load.ndim != 2 or 0 in load.shape:
        raise PlacementError(f"load file {path} must hold [layers, experts] numbers, got shape {list(load.shape)}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise PlacementError(f"load file {path} must hold finite, non-negative token counts")
    return load


def _check_tokens(load: np.ndarray, path: str) -> None:
    """A placement needs tokens to balance: every layer routes the same tokens, so a layer with
    none means an empty recording or a broken file."""
    empty = np.nonzero(load.sum(axis=1) == 0)[0]
    if len(empty) == len(load):
        raise PlacementError(
            f"load file {path} holds no tokens (every count is 0): record load while serving "
            "(POST /start_expert_distribution_record, send requests, then /dump_expert_distribution_record) "
            "and pass the dumped file"
        )
    if len(empty):
        raise PlacementError(
            f"load file {path}: layers {empty.tolist()} hold no tokens while others do; every layer routes the "
            "same tokens, so the file is incomplete"
        )


def _parse_ranks(text: str, num_ranks: int) -> set[int]:
    try:
        ranks = {int(t) for t in text.split(",") if t.strip()}
    except ValueError as e:
        raise PlacementError(f"--dead must be comma-separated rank numbers like 3,7, got {text!r}") from e
    outside = sorted(r for r in ranks if not 0 <= r < num_ranks)
    if outside:
        raise PlacementError(f"--dead ranks {outside} are outside 0..{num_ranks - 1}")
    return ranks


def _parse_speeds(text: str, num_ranks: int) -> dict[int, float]:
    speeds = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        rank, sep, value = item.partition("=")
        try:
            speeds[int(rank)] = float(value)
        except ValueError as e:
            raise PlacementError(f"--speeds takes RANK=SPEED pairs like 3=0.5, got {item!r}") from e
        if not sep or not 0 <= int(rank) < num_ranks:
            raise PlacementError(f"--speeds entry {item!r} must name a rank in 0..{num_ranks - 1}")
    return speeds


def _deepseek(load: np.ndarray, args: argparse.Namespace, live: list[int], rank_nodes: dict) -> ExpertLocation:
    """Run DeepSeek's policy over the live ranks, then lay it out over all ranks (dead slots empty)."""
    num_live = len(live)
    num_nodes = 1
    groups = 1
    if args.policy == "hierarchical":
        per_node = [sum(1 for r in live if rank_nodes[r] == n) for n in range(args.nodes)]
        if len(set(per_node)) != 1:
            raise PlacementError(
                f"hierarchical EPLB needs the same number of live ranks on every node, got {per_node}; "
                "use --policy global or fault-aware"
            )
        num_nodes = args.nodes
        groups = args.groups if args.groups is not None else args.nodes
        if groups % num_nodes:
            raise PlacementError(f"--groups {groups} must be a multiple of --nodes {num_nodes} for hierarchical")
    phy2log, _, _ = rebalance_experts(load, num_live * args.slots, groups, num_nodes, num_live)
    full = np.full((load.shape[0], args.ranks, args.slots), -1, dtype=np.int64)
    full[:, live] = phy2log.reshape(load.shape[0], num_live, args.slots)
    return ExpertLocation.from_phy2log(full.reshape(load.shape[0], -1), args.slots, load.shape[1])


def _summary(args, location, load, live, rank_nodes, current) -> dict:
    balance = balancedness(location, load, live)
    summary = {
        "policy": args.policy,
        "ranks": args.ranks,
        "live_ranks": len(live),
        "slots_per_rank": args.slots,
        "nodes": args.nodes,
        "layers": location.num_layers,
        "experts": location.num_experts,
        "balancedness_mean": float(balance.mean()),
        "balancedness_min": float(balance.min()),
        "balancedness_per_layer": [round(float(b), 6) for b in balance],
        "replicas_sharing_node": replicas_sharing_node(location, rank_nodes),
        "copies_on_same_rank": copies_on_same_rank(location),
        "experts_without_live_replica": len(experts_without_live_replica(location, live)),
    }
    if current is not None:
        summary["slots_moved"] = slots_moved(current, location)
    return summary


def _print_summary(summary: dict, out: str | None) -> None:
    print(
        f"policy {summary['policy']}: {summary['ranks']} ranks ({summary['live_ranks']} live) x "
        f"{summary['slots_per_rank']} slots on {summary['nodes']} nodes; "
        f"{summary['layers']} layers x {summary['experts']} experts"
    )
    print(f"balancedness (mean/max rank load): mean {summary['balancedness_mean']:.4f}, "
          f"worst layer {summary['balancedness_min']:.4f}")
    print(f"replicas sharing a node: {summary['replicas_sharing_node']}")
    print(f"copies on a rank already holding the expert: {summary['copies_on_same_rank']}")
    print(f"experts without a live replica: {summary['experts_without_live_replica']}")
    if "slots_moved" in summary:
        print(f"slots moved from --from: {summary['slots_moved']}")
    print(f"placement written to {out}" if out else "placement not saved (use --out FILE, or --json to print it)")
