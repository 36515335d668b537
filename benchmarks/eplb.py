"""EPLB benchmark at DeepSeek-V3 size (58 MoE layers x 256 experts) with skewed loads.

For 32 ranks x 9 slots on 4 nodes and 320 ranks x 1 slot on 40 nodes: time to compute and
balancedness of the fault-aware policy against DeepSeek's; then, after 1 and 2 dead ranks, the
fault-aware re-placement (from the placement in use) against recomputing from scratch over the
live ranks: balancedness and bytes moved.

Goals: under 100 ms per placement for 58 x 256 on 32 ranks; after one dead rank the fault-aware
policy moves at most half the bytes of a from-scratch recompute, with balancedness within 2% of it.
Also EPLB in the loop: the same ranks under a drifted load, for three movement tolerances.

    .venv/bin/python benchmarks/eplb.py [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from elastic_ep.placement import (
    ExpertLocation,
    balancedness,
    fault_aware_placement,
    rebalance_experts,
    replicas_sharing_node,
    slots_moved,
)

LAYERS, EXPERTS, GROUPS = 58, 256, 8
# one routed expert of DeepSeek-V3 in FP8: gate, up (7168 x 2048 each) and down (2048 x 7168)
EXPERT_NBYTES = 3 * 7168 * 2048
SETUPS = [(32, 9, 4), (320, 1, 40)]
LOADS = {"lognormal s=1": 1.0, "lognormal s=2": 2.0}
REPEATS = 5
DRIFT_SIGMA = 0.3


def timed(fn):
    """(result, median CPU ms): CPU time, because the development machine's cores are shared."""
    times, result = [], None
    for _ in range(REPEATS):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return result, statistics.median(times) * 1e3


def deepseek(load, ranks, slots, groups, nodes, live):
    """DeepSeek's policy over `live`, laid out over all ranks (dead slots empty)."""
    phy2log, _, _ = rebalance_experts(load, len(live) * slots, groups, nodes, len(live))
    full = np.full((LAYERS, ranks, slots), -1, dtype=np.int64)
    full[:, live] = phy2log.reshape(LAYERS, len(live), slots)
    return ExpertLocation.from_phy2log(full.reshape(LAYERS, -1), slots, EXPERTS)


def bench_setup(load, ranks, slots, nodes):
    rank_nodes = {r: r // (ranks // nodes) for r in range(ranks)}
    everyone = list(range(ranks))
    fresh, fa_ms = timed(lambda: fault_aware_placement(load, everyone, rank_nodes, None, slots, ranks))
    rows = [{"policy": "fault-aware", "ms": fa_ms, "loc": fresh}]
    if GROUPS % nodes == 0:
        loc, ms = timed(lambda: deepseek(load, ranks, slots, GROUPS, nodes, everyone))
        rows.append({"policy": "deepseek hierarchical", "ms": ms, "loc": loc})
    loc, ms = timed(lambda: deepseek(load, ranks, slots, 1, 1, everyone))
    rows.append({"policy": "deepseek global", "ms": ms, "loc": loc})
    initial = [
        {"policy": r["policy"], "ms": round(r["ms"], 1),
         "balancedness_mean": round(float(balancedness(r["loc"], load).mean()), 4),
         "balancedness_min": round(float(balancedness(r["loc"], load).min()), 4),
         "replicas_sharing_node": replicas_sharing_node(r["loc"], rank_nodes)}
        for r in rows
    ]
    failures = []
    for dead in ([ranks // 2 + 1], [ranks // 2 + 1, ranks // 4 + 2]):
        live = [r for r in everyone if r not in dead]
        kept, kept_ms = timed(lambda live=live: fault_aware_placement(
            load, live, rank_nodes, None, slots, ranks, current=fresh))
        scratch, scratch_ms = timed(lambda live=live: fault_aware_placement(load, live, rank_nodes, None, slots, ranks))
        ds = deepseek(load, ranks, slots, 1, 1, live)
        entry = {"dead": dead}
        for name, loc, ms in (("fault-aware", kept, kept_ms), ("scratch fault-aware", scratch, scratch_ms),
                              ("scratch deepseek global", ds, None)):
            entry[name] = {
                "ms": None if ms is None else round(ms, 1),
                "balancedness_mean": round(float(balancedness(loc, load, live).mean()), 4),
                "gb_moved": round(slots_moved(fresh, loc) * EXPERT_NBYTES / 1e9, 2),
            }
        ref = entry["scratch fault-aware"]
        entry["bytes_ratio"] = round(entry["fault-aware"]["gb_moved"] / ref["gb_moved"], 3)
        entry["balance_ratio"] = round(entry["fault-aware"]["balancedness_mean"] / ref["balancedness_mean"], 4)
        failures.append(entry)
    return {"ranks": ranks, "slots": slots, "nodes": nodes, "initial": initial, "failures": failures,
            "drift": bench_drift(load, fresh, rank_nodes, ranks, slots)}


def bench_drift(load, fresh, rank_nodes, ranks, slots):
    """EPLB in the loop: same ranks, the load drifts (x lognormal(0, 0.3) per expert)."""
    drifted = load * np.random.default_rng(1).lognormal(0.0, DRIFT_SIGMA, load.shape)
    everyone = list(range(ranks))
    rows = [{"policy": "placement in use", "balancedness_mean": float(balancedness(fresh, drifted).mean()),
             "gb_moved": 0.0, "ms": None}]
    for tolerance in (0.0, 0.01, 0.05):
        loc, ms = timed(lambda tolerance=tolerance: fault_aware_placement(
            drifted, everyone, rank_nodes, None, slots, ranks, current=fresh, movement_tolerance=tolerance))
        rows.append({"policy": f"fault-aware, tolerance {tolerance}", "loc": loc, "ms": ms})
    loc, ms = timed(lambda: fault_aware_placement(drifted, everyone, rank_nodes, None, slots, ranks))
    rows.append({"policy": "scratch fault-aware", "loc": loc, "ms": ms})
    for row in rows:
        loc = row.pop("loc", None)
        if loc is not None:
            row["balancedness_mean"] = float(balancedness(loc, drifted).mean())
            row["gb_moved"] = slots_moved(fresh, loc) * EXPERT_NBYTES / 1e9
        row["balancedness_mean"] = round(row["balancedness_mean"], 4)
        row["gb_moved"] = round(row["gb_moved"], 2)
        row["ms"] = None if row["ms"] is None else round(row["ms"], 1)
    return rows


def print_markdown(results):
    print(f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}, numpy {np.__version__}")
    for res in results:
        print(f"\n### {res['load']}: {res['ranks']} ranks x {res['slots']} slots, {res['nodes']} nodes\n")
        print("| policy | CPU ms | balancedness mean | worst layer | replicas sharing a node |")
        print("|---|---|---|---|---|")
        for r in res["initial"]:
            print(f"| {r['policy']} | {r['ms']} | {r['balancedness_mean']} | {r['balancedness_min']} "
                  f"| {r['replicas_sharing_node']} |")
        print("\n| dead | policy | CPU ms | balancedness mean | GB moved |")
        print("|---|---|---|---|---|")
        for f in res["failures"]:
            for name in ("fault-aware", "scratch fault-aware", "scratch deepseek global"):
                e = f[name]
                ms = "" if e["ms"] is None else e["ms"]
                print(f"| {','.join(map(str, f['dead']))} | {name} | {ms} | "
                      f"{e['balancedness_mean']} | {e['gb_moved']} |")
            print(f"| | fault-aware / scratch | | {f['balance_ratio']} | {f['bytes_ratio']} |")
        print(f"\nEPLB in the loop, load drift x lognormal(0, {DRIFT_SIGMA}):\n")
        print("| policy | CPU ms | balancedness mean | GB moved |")
        print("|---|---|---|---|")
        for r in res["drift"]:
            print(f"| {r['policy']} | {'' if r['ms'] is None else r['ms']} | "
                  f"{r['balancedness_mean']} | {r['gb_moved']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for name, sigma in LOADS.items():
        load = np.random.default_rng(0).lognormal(0.0, sigma, (LAYERS, EXPERTS)) * 1000
        for ranks, slots, nodes in SETUPS:
            results.append({"load": name, **bench_setup(load, ranks, slots, nodes)})
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_markdown(results)


if __name__ == "__main__":
    main()
