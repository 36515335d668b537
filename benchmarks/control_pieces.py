"""Pieces of the control thread's work at 1,024 ranks, alone: a background rebalance's move
(placement/restore.py `step_towards`), the straggler verdict (policy/straggler_verdict.py
`judge`), and the placements over every member that a step boundary waited for before they went
off the control thread from 16 members on (control/epochs/off_thread.py): the straggler policy's
weighted placement for a rank derated to 0.3 (`plan_rebalance`) and EPLB's check after the same
rank's loss, for a load that moved to other experts (its plan and the from-scratch placement its
walk is judged against, `eplb_plan`).

    PYTHONPATH=src .venv/bin/python benchmarks/control_pieces.py [--baseline REV] [--repeats 3]

The move: 1,024 experts over 1,024 ranks (58 layers, the slots `--redundant-experts auto` gives
nodes of 8), a rank lost and its experts restored, walked towards a balanced placement for
another load (~118,000 slots differ), with at most 200 and 2,000 slots a move: best of
--repeats, perf_counter seconds. The verdict: 1,024 ranks in 10 intervals of 20 steps (one rank
3x slower), the intervals' rows already built as the controller's repeated judgements find
them: milliseconds per `judge`, the mean of 20. The placements: one run each, perf_counter seconds
(this code only: --baseline leaves them out). --baseline REV runs the same with that git
revision's `src` in a child process and prints both side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_ep.control.epochs.rebalance_rules import plan_rebalance
from elastic_ep.placement import fault_aware_placement
from elastic_ep.placement.restore import restore_placement, step_towards
from elastic_ep.policy.straggler_verdict import Interval, RankInterval, StragglerRule, judge
from restore_placement import balanced, best_of

RANKS = 1024


def measure(repeats: int, placements: bool = True) -> list[dict]:
    rows = []
    placement, load, nodes, _, slots = balanced(58, 1024, RANKS, 0)
    live = [r for r in range(RANKS) if r != RANKS // 3]
    current = restore_placement(placement.restricted_to(live), load, live, nodes)
    other = load[:, ::-1].copy()  # the same loads on other experts: most slots move
    target = fault_aware_placement(other, live, nodes, None, slots, RANKS)
    differ = int((current.phy2log != target.phy2log).sum())
    for max_slots in (200, 2000):
        s, _ = best_of(lambda: step_towards(current, target, max_slots, load), repeats)  # noqa: B023
        rows.append({"move": f"{differ:,} slots differ, at most {max_slots:,} a move", "s": round(s, 4)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if placements:
        t = time.perf_counter()
        plan_rebalance(placement, load, list(range(RANKS)), nodes, {7: 0.3}, 1.0)
        rows.append({"placement": "the weighted placement of a derate (plan_rebalance)",
                     "s": round(time.perf_counter() - t, 2)})
        t = time.perf_counter()
        from elastic_ep.control.epochs.rebalance_rules import eplb_plan  # this tree's: not in a --baseline's src
        plan, _ = eplb_plan(current, other, live, nodes, None, 1.0)
        rows.append({"placement": f"EPLB's check after a loss (eplb_plan; a plan: {plan is not None})",
                     "s": round(time.perf_counter() - t, 2)})
    rnd = random.Random(1)
    intervals = [Interval(10.0 + k * 0.5, 10.5 + k * 0.5,
                          {r: RankInterval(20, (0.06 if r == 7 else 0.02) * 20 * (1 + rnd.random() / 10), 80)
                           for r in range(RANKS)}) for k in range(10)]
    rule = StragglerRule()
    verdicts = judge(intervals, rule, 15.0, range(RANKS))  # the rows built once, as the controller's first judgement
    t = time.perf_counter()
    for _ in range(20):
        judge(intervals, rule, 15.0, range(RANKS))
    rows.append({"verdict": f"{RANKS:,} ranks x 10 intervals", "ms": round((time.perf_counter() - t) / 20 * 1000, 2),
                 "stragglers": sorted(r for r, v in verdicts.items() if v.kind.value == "straggler")})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None, metavar="REV", help="also run with this git revision's src")
    parser.add_argument("--json", action="store_true", help="print this code's rows as JSON (the child's output)")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.repeats, placements=False)))
        return
    before: list[dict] = []
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
    print("| placement over 1,024 ranks, now off the control thread | s |")
    print("|---|---|")
    for a in [a for a in after if "placement" in a]:
        print(f"| {a['placement']} | {a['s']} |")
    print()
    print("| piece | before | after | ratio |")
    print("|---|---|---|---|")
    for i, a in enumerate([a for a in after if "placement" not in a]):
        b = before[i] if before else {}
        unit = "s" if "move" in a else "ms"
        name = a.get("move") or f"judge: {a['verdict']} (stragglers {a['stragglers']})"
        ratio = f"{b[unit] / a[unit]:.1f}x" if b and a[unit] else "-"
        print(f"| {name} | {b.get(unit, '-')} {unit} | {a[unit]} {unit} | {ratio} |")


if __name__ == "__main__":
    main()
