"""/metrics at 1,024 ranks: series count, scrape size and cost, before and after the per-rank bound.

    .venv/bin/python benchmarks/metrics_cardinality.py [--ranks 1024] [--top-k 16] [--before REV] [--json]

A synthetic cluster state, no processes: `--ranks` ranks on nodes of 8, `--steps` completed steps
of results with each rank's step, wait and own time (one rank 4x slower, one stalled, one down),
then the liveness gauges the publisher sets; then one scrape of the registry (Prometheus text
format, as GET /metrics sends it). Counted: series (sample lines), bytes, series carrying a `rank`
label; timed: recording one step's results for every rank, and one scrape.

- after: this tree, `--metrics-top-k` `--top-k`, no `_created` series (what `serve` runs).
- before (`--before REV`, e.g. the commit before the bound): the same state fed to that revision's
  ClusterMetrics, whose every per-rank metric had a series per rank (and `_created` series), read
  from `git archive REV src` into a temporary directory and run in a child process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def synthetic(ranks: int, seed: int = 0):
    """Per rank: step, wait and own seconds of one step, tokens; the slow, stalled and down ranks."""
    rng = np.random.default_rng(seed)
    own = rng.normal(0.010, 0.0005, ranks).clip(0.005)
    own[ranks // 3] *= 4  # a straggler
    step = np.full(ranks, own.max() + 0.001)
    return step, step - own, own, rng.integers(8, 16, ranks), {ranks // 2: "stalled", ranks - 1: "down"}


def record_ms(step_once, steps: int) -> float:
    """Mean time (ms) of recording one step's results."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step_once()
    return round((time.perf_counter() - t0) / steps * 1000, 3)


def scrape_figures(registry, generate_latest) -> dict:
    t0 = time.perf_counter()
    text = generate_latest(registry).decode()
    scrape_ms = (time.perf_counter() - t0) * 1000
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {"series": len(samples), "bytes": len(text.encode()),
            "rank_series": sum('rank="' in s for s in samples),
            "ranks_labelled": len({s.split('rank="')[1].split('"')[0] for s in samples if 'rank="' in s}),
            "created_series": sum(s.split("{")[0].split(" ")[0].endswith("_created") for s in samples),
            "scrape_ms": round(scrape_ms, 2)}


def after(ranks: int, top_k: int, steps: int) -> dict:
    from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest

    from elastic_ep.control.metrics import ClusterMetrics
    from elastic_ep.wire import StepResult

    disable_created_metrics()
    step, wait, own, tokens, flagged = synthetic(ranks)
    registry = CollectorRegistry()
    m = ClusterMetrics(registry, "model", top_k)
    results = {r: StepResult(0, 0, r, {}, float(step[r]), float(own[r]), float(wait[r] / 2), float(wait[r] / 2),
                             np.zeros((1, 1), np.int64), 0, {}, remote_messages=8, remote_bytes=4096)
               for r in range(ranks)}
    per_rank_tokens = {r: int(tokens[r]) for r in range(ranks)}
    step_ms = record_ms(lambda: m.rank_step(results, per_rank_tokens), steps)
    for name in ("elastic_ep_rank_up", "elastic_ep_rank_heartbeat_age_seconds", "elastic_ep_rank_stalled_seconds",
                 "elastic_ep_rank_last_progress_timestamp_seconds", "elastic_ep_expert_load_imbalance"):
        m.ranks.set_gauge(name, dict.fromkeys(range(ranks), 1.0))
    t0 = time.perf_counter()
    m.ranks.select(flagged, range(ranks), time.monotonic())
    select_ms = round((time.perf_counter() - t0) * 1000, 3)
    return {**scrape_figures(registry, generate_latest), "record_step_ms": step_ms, "select_ms": select_ms,
            "exported": dict(sorted(m.ranks.exported.items()))}


# The driver of the old ClusterMetrics (a series per rank for every per-rank metric), run in a child
# process on `git archive REV src`.
BEFORE_DRIVER = """
import json, sys
from prometheus_client import CollectorRegistry, generate_latest
sys.path.insert(0, sys.argv[1])
from metrics_cardinality import synthetic, record_ms, scrape_figures
from elastic_ep.control.metrics import ClusterMetrics
ranks, steps = int(sys.argv[2]), int(sys.argv[3])
step, wait, own, tokens, flagged = synthetic(ranks)
registry = CollectorRegistry()
m = ClusterMetrics(registry)
def step_once():
    for r in range(ranks):
        label = str(r)
        m.step_seconds.labels(label).observe(step[r])
        m.collective_wait_seconds.labels(label).observe(wait[r])
        m.rank_tokens.labels(label).set(tokens[r])  # as the old step loop did, per rank per step
        m.rank_tokens_total.labels(label).inc(tokens[r])
        m.remote_messages.labels(label).inc(8)
        m.remote_bytes.labels(label).inc(4096)
        m.expert_load_imbalance.labels(label).set(1.0)
for r in range(ranks):
    for g in (m.rank_up, m.rank_heartbeat_age_seconds, m.rank_stalled_seconds, m.rank_last_progress_seconds):
        g.labels(str(r)).set(1.0)
step_ms = record_ms(step_once, steps)
print(json.dumps({**scrape_figures(registry, generate_latest), "record_step_ms": step_ms}))
"""


def before(rev: str, ranks: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env_path = f"{tmp}/src"
        out = subprocess.run([sys.executable, "-c", BEFORE_DRIVER, str(Path(__file__).parent), str(ranks), str(steps)],
                             check=True, capture_output=True, text=True,
                             env={"PYTHONPATH": env_path, "PATH": "/usr/bin"})
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--before", default=None, metavar="REV", help="also measure this git revision's ClusterMetrics")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = {}
    if args.before:
        rows[f"before ({args.before})"] = before(args.before, args.ranks, args.steps)
    rows[f"after (--metrics-top-k {args.top_k})"] = after(args.ranks, args.top_k, args.steps)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    keys = ["series", "rank_series", "ranks_labelled", "created_series", "bytes", "scrape_ms", "record_step_ms"]
    print(f"{args.ranks} ranks, {args.steps} steps recorded")
    print(f"{'':32s}" + "".join(f"{k:>15s}" for k in keys))
    for name, row in rows.items():
        print(f"{name:32s}" + "".join(f"{row[k]:>15}" for k in keys))
    exported = rows[f"after (--metrics-top-k {args.top_k})"]["exported"]
    print("exported ranks:", ", ".join(f"{r} ({why})" for r, why in exported.items()))


if __name__ == "__main__":
    main()
