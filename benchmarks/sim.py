"""Time of the fleet simulation and of the redundancy analysis.

    PYTHONPATH=src .venv/bin/python benchmarks/sim.py [--repeat 3]
    PYTHONPATH=src .venv/bin/python benchmarks/sim.py --at-scale [--baseline REV]

Without --at-scale: the fleet at 10,000 GPUs x 365 days (1 and 10 replications, in this process),
the redundancy analysis and `elastic-ep sim blast-radius`, one line each, best of --repeat runs,
wall-clock seconds.

--at-scale: the fleet at 100,000 GPUs x 365 days, 1 and 10 replications with --jobs 1 and with
--jobs N (the usable cores), and `elastic-ep sim fleet --gpus 100000 --days 365` with its defaults
start to finish, each once in a fresh process: wall seconds, and CPU seconds of the process and the
workers it ran. With --baseline REV each row runs on the `src` of git revision REV too, right
before this tree's (a tree whose `simulate_fleet` has no `jobs` runs serially: n/a for --jobs N),
and the table has both side by side with the ratio of their wall times.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from elastic_ep.sim.fleet import FleetConfig, simulate_fleet
from elastic_ep.sim.redundancy import SEED_001_CONFIGS, analyse, domain_map, random_placements

AT_SCALE = ("--gpus", "100000", "--days", "365")


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def children_cpu_s() -> float:
    """CPU seconds of the children this process has waited for (and of theirs, once waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_fleet(replications: int, jobs: int) -> dict[str, float] | None:
    """One simulate_fleet at 100,000 GPUs x 365 days in this process: wall and CPU seconds (this
    process's and its workers'). None when this tree's simulate_fleet cannot run `jobs` > 1."""
    kwargs = {"jobs": jobs} if "jobs" in inspect.signature(simulate_fleet).parameters else {}
    if jobs > 1 and not kwargs:
        return None
    cfg = FleetConfig(gpus=100_000, days=365)
    wall, cpu, children = time.perf_counter(), time.process_time(), children_cpu_s()
    simulate_fleet(cfg, replications, seed=0, **kwargs)
    return {"wall_s": time.perf_counter() - wall,
            "cpu_s": time.process_time() - cpu + children_cpu_s() - children}


def run_row(src: Path, row: list[str]) -> dict[str, float] | None:
    """One --at-scale row in a fresh process on the tree at `src`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    if row[0] == "cli":
        wall, children = time.perf_counter(), children_cpu_s()
        subprocess.run([sys.executable, "-m", "elastic_ep.cli", "sim", "fleet", *AT_SCALE], check=True,
                       capture_output=True, env=env)
        return {"wall_s": time.perf_counter() - wall, "cpu_s": children_cpu_s() - children}
    done = subprocess.run([sys.executable, __file__, "--row", *row], check=True, capture_output=True, text=True,
                          env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def at_scale(baseline: str | None) -> None:
    jobs = len(os.sched_getaffinity(0))
    rows = [
        ("1 replication, --jobs 1", ["1", "1"]),
        (f"1 replication, --jobs {jobs}", ["1", str(jobs)]),
        ("10 replications (the default), --jobs 1", ["10", "1"]),
        (f"10 replications, --jobs {jobs} (the default)", ["10", str(jobs)]),
        (f"`elastic-ep sim fleet {' '.join(AT_SCALE)}` (defaults, start to finish)", ["cli"]),
    ]
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": here / "src"}
        if baseline:
            archive = subprocess.run(["git", "-C", str(here), "archive", baseline, "src"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            trees = {baseline: Path(tmp) / "src", **trees}
        print(f"100,000 GPUs x 365 days, seed 0; {jobs} usable cores; load average before: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        names = list(trees)
        print("| what | " + " | ".join(f"{n} wall s | {n} CPU s" for n in names)
              + (" | wall ratio |" if len(names) == 2 else " |"))
        print("|---|" + "---|---|" * len(names) + ("---|" if len(names) == 2 else ""))
        for what, row in rows:
            got = [run_row(src, row) for src in trees.values()]
            cells = ["n/a | n/a" if g is None else f"{g['wall_s']:.2f} | {g['cpu_s']:.2f}" for g in got]
            ratio = ""
            if len(got) == 2:
                ratio = " n/a |" if None in got else f" {got[0]['wall_s'] / got[1]['wall_s']:.2f}x |"
            print(f"| {what} | " + " | ".join(cells) + " |" + ratio, flush=True)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def small(repeat: int) -> None:
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, numpy {np.__version__}"
    )

    cfg = FleetConfig(gpus=10_000, days=365)
    for replications in (1, 10):
        seconds = best_of(repeat, lambda r=replications: simulate_fleet(cfg, r, seed=0))
        report = simulate_fleet(cfg, replications, seed=0)
        print(
            f"fleet 10,000 GPUs x 365 days, 3 policies, {replications:2d} replication(s): {seconds:6.2f} s "
            f"({report.failures.mean:.0f} failures per replication)"
        )

    for cfg_r in SEED_001_CONFIGS:
        placement = random_placements(cfg_r, 1, np.random.default_rng(0))
        domains = domain_map(cfg_r.ranks)
        for method, trials in (("monte-carlo", 4000), ("exact", 0)):
            seconds = best_of(
                repeat,
                lambda p=placement, m=method, t=trials, c=cfg_r, d=domains: analyse(
                    p, c.slots_per_rank, d, [1, 2, 4], m, t, np.random.default_rng(0)
                ),
            )
            print(f"redundancy {cfg_r.name:36s} k=1,2,4 {method:11s}: {seconds:6.3f} s")

    cli = [sys.executable, "-m", "elastic_ep.cli", "sim", "blast-radius"]
    seconds = best_of(repeat, lambda: subprocess.run(cli, check=True, capture_output=True))
    print(f"`elastic-ep sim blast-radius` start to finish: {seconds:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--at-scale", action="store_true", help="the fleet at 100,000 GPUs (see above)")
    parser.add_argument("--baseline", metavar="REV", help="--at-scale: also run git revision REV's src")
    parser.add_argument("--row", nargs=2, metavar=("REPLICATIONS", "JOBS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(time_fleet(int(args.row[0]), int(args.row[1]))))
    elif args.at_scale:
        at_scale(args.baseline)
    else:
        small(args.repeat)


if __name__ == "__main__":
    main()
