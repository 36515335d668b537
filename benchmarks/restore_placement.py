"""The recovery's placement alone (placement/restore.py `restore_placement`, and the transfer plan
from the held slots to it) at DeepSeek-V3's shape, over large groups, after the loss of a rank
and of a node of 8.

    PYTHONPATH=src .venv/bin/python benchmarks/restore_placement.py [--baseline REV] [--repeats 3]

Each case: a balanced placement (fault_aware_placement) of 58 layers x E experts over R ranks of
s slots (s as `--redundant-experts auto` chooses it for nodes of 8: the group outlives a node),
a Zipf-like load, every expert in some node's host-memory backup; the ranks of the loss leave,
the rest hold what they held. Times are perf_counter seconds, best of --repeats (one run where a
run takes over 5 s). --baseline REV runs the same cases with that git revision's `src` in a
child process and prints both side by side. The last column is what building the restored
placement's log2phy [L, E, R] costs (`build_log2phy`: what every placement paid before it was
built on first read, and what a worker's routing still pays once per epoch) and its size.
Two more tables: `ExpertLocation.from_phy2log` of a slot map whose one expert sits on every
rank (R = ranks + 1), with and without log2phy read; and the restores computed ahead
(`restores_ahead`) for a sample of an epoch's likely losses, scaled to all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from elastic_ep.placement import choose_redundant_experts, fault_aware_placement, plan_transfers
from elastic_ep.placement.location import ExpertLocation, build_log2phy
from elastic_ep.placement.restore import restore_placement
from elastic_ep.placement.restore_ahead import likely_losses, restores_ahead

RANKS_PER_NODE = 8
# (layers, experts, ranks, slots per rank or 0 for the redundancy's choice, what is lost)
CASES = [(58, 256, 256, 0, "rank"), (58, 256, 256, 0, "node"), (58, 1024, 1024, 0, "rank"),
         (58, 1024, 1024, 0, "node"), (58, 256, 4, 128, "every rank")]

# (layers, experts, ranks, slots per rank): a slot map with expert 0 in every rank's first slot
# (R = ranks + 1, as after the control-plane benchmark's rebalance spread its one sequence's
# experts) and the rest at random: what `ExpertLocation.from_phy2log` costs with and without log2phy
MAPS = [(58, 256, 256, 10), (58, 256, 1024, 10)]
# (layers, experts, ranks, slots per rank): the restores computed ahead (restores_ahead) for a
# sample of an epoch's likely losses (the first 16 single ranks and the last 4 nodes), scaled to
# all of them; 256 experts x 10 slots is the control-plane benchmark's shape (every expert has
# several copies, no single rank or node takes every one), 1,024 x 2 the first table's
AHEAD = [(58, 256, 1024, 10), (58, 1024, 1024, 0)]


def balanced(layers: int, experts: int, ranks: int, slots: int):
    """A balanced placement, its Zipf-like load [L, E], nodes and backups, and its slots per rank."""
    nodes = {r: f"n{r // RANKS_PER_NODE}" for r in range(ranks)}
    slots = slots or choose_redundant_experts(experts, ranks, layers, 1, nodes).slots_per_rank
    rng = np.random.default_rng(0)
    load = np.stack([rng.permutation(1000.0 / np.arange(1, experts + 1)) for _ in range(layers)])
    placement = fault_aware_placement(load, range(ranks), nodes, None, slots, ranks)
    backup = {(layer, e): f"n{e % len(set(nodes.values()))}" for layer in range(layers) for e in range(experts)}
    return placement, load, nodes, backup, slots


def case_inputs(layers: int, experts: int, ranks: int, slots: int, loss: str):
    placement, load, nodes, backup, slots = balanced(layers, experts, ranks, slots)
    lost = {"rank": [ranks // 3], "node": [r for r in range(ranks) if nodes[r] == nodes[ranks // 3]],
            "every rank": list(range(ranks))}[loss]
    live = [r for r in range(ranks) if r not in lost]
    holding = live if live else list(range(ranks))  # every rank lost: all restart empty
    held = placement.restricted_to(live)
    return held, load, holding, nodes, backup, slots


def best_of(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        if times[-1] > 5:
            break
    return min(times), out


def measure(repeats: int) -> list[dict]:
    rows = []
    for layers, experts, ranks, slots, loss in CASES:
        held, load, holding, nodes, backup, s = case_inputs(layers, experts, ranks, slots, loss)
        restore_s, new = best_of(lambda: restore_placement(held, load, holding, nodes, backup), repeats)  # noqa: B023
        plan_s, _ = best_of(lambda: plan_transfers(held, new, holding, nodes, backup, 1), repeats)  # noqa: B023
        log2phy_s, (log2phy, _) = best_of(lambda: build_log2phy(new.phy2log, experts), repeats)  # noqa: B023
        rows.append({"case": f"{layers} x {experts} over {ranks} ranks x {s} slots, {loss} lost",
                     "lost_experts": int((held.restricted_to(holding).logcnt == 0).sum()),
                     "restore_s": round(restore_s, 4), "plan_s": round(plan_s, 4),
                     "log2phy_s": round(log2phy_s, 4), "log2phy_mb": round(log2phy.nbytes / 2**20, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for layers, experts, ranks, slots in MAPS:
        p = np.random.default_rng(0).integers(0, experts, (layers, ranks * slots))
        p[:, ::slots] = 0
        build_s, loc = best_of(lambda: ExpertLocation.from_phy2log(p, slots, experts), repeats)  # noqa: B023
        read_s, _ = best_of(lambda: ExpertLocation.from_phy2log(p, slots, experts).log2phy, repeats)  # noqa: B023
        rows.append({"map": f"[{layers}, {ranks * slots:,}] slot map: {experts} experts over {ranks:,} ranks x "
                            f"{slots} slots, R = {int(loc.logcnt.max())}",
                     "build_s": round(build_s, 4), "with_log2phy_s": round(read_s, 4),
                     "log2phy_mb": round(loc.log2phy.nbytes / 2**20, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for layers, experts, ranks, slots in AHEAD:
        placement, load, nodes, backup, s = balanced(layers, experts, ranks, slots)
        losses = likely_losses(range(ranks), nodes)
        sample = losses[:16] + losses[-4:]
        ahead_s, fills = best_of(lambda: restores_ahead(placement.phy2log, s, experts, load, list(range(ranks)),  # noqa: B023
                                                        nodes, backup, sample), 1)  # noqa: B023
        rows.append({"ahead": f"{experts} experts over {ranks:,} ranks x {s} slots: {len(losses):,} likely losses",
                     "losses_filling": sum(1 for f in fills.values() if f is None or len(f)),
                     "sample": len(sample), "sample_s": round(ahead_s, 3),
                     "all_s": round(ahead_s / len(sample) * len(losses), 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None, metavar="REV", help="also run with this git revision's src")
    parser.add_argument("--json", action="store_true", help="print this code's rows as JSON (the child's output)")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.repeats)))
        return
    before = None
    if args.baseline:
        repo = Path(__file__).resolve().parent.parent
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(["git", "-C", str(repo), "archive", args.baseline, "src"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            done = subprocess.run([sys.executable, __file__, "--json", "--repeats", str(args.repeats)],
                                  capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(tmp) / "src")})
            before = json.loads(done.stdout.strip().splitlines()[-1])
    after = measure(args.repeats)
    print("| case | lost experts | restore s before | restore s after | ratio | transfer plan s before | after "
          "| log2phy of one placement: s, MB |")
    print("|---|---|---|---|---|---|---|---|")
    for a, b, ratio in _paired(after, before, "case", "restore_s"):
        print(f"| {a['case']} | {a['lost_experts']} | {b.get('restore_s', '-')} | {a['restore_s']} | {ratio} "
              f"| {b.get('plan_s', '-')} | {a['plan_s']} | {a['log2phy_s']}, {a['log2phy_mb']} |")
    print()
    print("| slot map | from_phy2log s before | after | ratio | after, log2phy read too | log2phy MB |")
    print("|---|---|---|---|---|---|")
    for a, b, ratio in _paired(after, before, "map", "build_s"):
        print(f"| {a['map']} | {b.get('build_s', '-')} | {a['build_s']} | {ratio} | {a['with_log2phy_s']} "
              f"| {a['log2phy_mb']} |")
    print()
    print("| restores ahead | sample losses (filling) | sample s before | after | ratio | all losses s before "
          "| after |")
    print("|---|---|---|---|---|---|---|")
    for a, b, ratio in _paired(after, before, "ahead", "sample_s"):
        print(f"| {a['ahead']} | {a['sample']} ({a['losses_filling']}) | {b.get('sample_s', '-')} | {a['sample_s']} "
              f"| {ratio} | {b.get('all_s', '-')} | {a['all_s']} |")


def _paired(after: list[dict], before: list[dict] | None, kind: str, timed: str):
    """(after row, before row or {}, before/after ratio of `timed`) for the rows of one table
    (those with the key `kind`); both runs list the same rows in the same order."""
    for i, a in enumerate(after):
        if kind not in a:
            continue
        b = before[i] if before else {}
        yield a, b, f"{b[timed] / a[timed]:.0f}x" if b and a[timed] else "-"

if __name__ == "__main__":
    main()
