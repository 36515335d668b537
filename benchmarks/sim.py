"""Time of the fleet simulation at 10,000 GPUs over 365 days, and of the redundancy analysis.

Run: .venv/bin/python benchmarks/sim.py
Prints one line per measurement (best of --repeat runs, wall-clock seconds).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import numpy as np

from elastic_ep.sim.fleet import FleetConfig, simulate_fleet
from elastic_ep.sim.redundancy import SEED_001_CONFIGS, analyse, domain_map, random_placements


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, numpy {np.__version__}"
    )

    cfg = FleetConfig(gpus=10_000, days=365)
    for replications in (1, 10):
        seconds = best_of(args.repeat, lambda r=replications: simulate_fleet(cfg, r, seed=0))
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
                args.repeat,
                lambda p=placement, m=method, t=trials, c=cfg_r, d=domains: analyse(
                    p, c.slots_per_rank, d, [1, 2, 4], m, t, np.random.default_rng(0)
                ),
            )
            print(f"redundancy {cfg_r.name:36s} k=1,2,4 {method:11s}: {seconds:6.3f} s")

    cli = [sys.executable, "-m", "elastic_ep.cli", "sim", "blast-radius"]
    seconds = best_of(args.repeat, lambda: subprocess.run(cli, check=True, capture_output=True))
    print(f"`elastic-ep sim blast-radius` start to finish: {seconds:.2f} s")


if __name__ == "__main__":
    main()
