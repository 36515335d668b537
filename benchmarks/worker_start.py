"""A rank's process started by exec against forked from the node's zygote (`serve --worker-start`),
side by side: the modes alternate, their order swapped every round.

    PYTHONPATH=src .venv/bin/python benchmarks/worker_start.py [--ranks 4] [--rounds 3] [--json]

First the process alone: `--spawns` times each, alternating, a process that has the worker's
modules imported and exits at once (exec: `python -c "import elastic_ep.runtime.worker"`; fork:
from a zygote that imported them, a target that returns 0), from the start to its exit status
read. Then per round and mode, one `elastic-ep serve` of the embedded tiny DeepSeek-V3 on one node:
- ready s: from the server process's start to GET /ready answering 200 (every rank started,
  loaded, in the first epoch);
- restart s: a rank's process SIGKILLed (by its pid, the real fault), then from the kill to every
  rank serving again with a new process in that rank's place (`--restart-delay-s 0`: the
  controller asks the agent to start it again at once; the new process loads, joins and the
  group forms a new epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_ep.harness.server_process import ServerProcess
from elastic_ep.node.zygote import Zygote
from elastic_ep.parent_death import adopt_orphans

MODES = ("exec", "fork")


def one(mode: str, ranks: int, model: str, log: Path) -> dict:
    flags = ["--model", model, "--ep-size", str(ranks), "--worker-start", mode, "--restart-delay-s", "0",
             "--no-warmup-gate"]
    t0 = time.monotonic()
    server = ServerProcess(flags, log, ready_timeout_s=None)
    try:
        server.wait_ready(300)
        ready_s = time.monotonic() - t0
        server.wait_full_group(ranks, timeout_s=120)
        old = server.pids()
        victim = sorted(old)[-1]
        t_kill = time.monotonic()
        os.kill(old[victim], signal.SIGKILL)
        server.wait_for(lambda c: c["ready"] and len(c["members"]) == ranks
                        and all(r["state"] == "serving" for r in c["ranks"])
                        and {r["rank_id"]: r["pid"] for r in c["ranks"]}.get(victim) not in (None, old[victim]),
                        timeout_s=120, what=f"rank {victim} serving again in a new process")
        restart_s = time.monotonic() - t_kill
    finally:
        server.stop()
    return {"mode": mode, "ranks": ranks, "ready_s": round(ready_s, 3), "restart_s": round(restart_s, 3)}


def spawns(count: int) -> dict[str, list[float]]:
    """Seconds from the start of a process that has the worker imported to its exit status, per mode."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    adopt_orphans()
    zygote = Zygote(env)
    if not zygote.wait_ready(120):
        raise RuntimeError("the zygote was not ready in 120 s")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for i in range(count):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                t0 = time.monotonic()
                if mode == "exec":
                    subprocess.run([sys.executable, "-c", "import elastic_ep.runtime.worker"], env=env, check=True)
                else:
                    child = zygote.fork("builtins:len", [], "worker_start benchmark")  # len([]): exits 0
                    child.release()
                    child.stdin.close()
                    assert child.wait() == 0
                times[mode].append(time.monotonic() - t0)
    finally:
        zygote.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--spawns", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="one JSON line per run")
    args = parser.parse_args()
    alone = spawns(args.spawns)
    print(json.dumps({"spawn_s": alone}) if args.json else
          "process alone: " + ", ".join(f"{m} median {statistics.median(alone[m]):.3f} s" for m in MODES), flush=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="worker-start-") as tmp:
        for round_ in range(args.rounds):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                run = {"round": round_ + 1, **one(mode, args.ranks, args.model, Path(tmp) / f"{mode}-{round_}.log")}
                runs.append(run)
                print(json.dumps(run) if args.json else f"round {run['round']} {mode}: ready {run['ready_s']} s, "
                      f"restart {run['restart_s']} s", flush=True)
    if not args.json:
        print("\n| median | exec s | fork s | exec / fork |\n|---|---|---|---|")
        exec_s, fork_s = (statistics.median(alone[m]) for m in MODES)
        print(f"| a process with the worker imported, start to exit ({args.spawns} each) | {exec_s:.3f} | "
              f"{fork_s:.3f} | {exec_s / fork_s:.1f}x |")
        for key, what in ((("ready_s", f"serve, {args.ranks} ranks: start to /ready ({args.rounds} each)"),
                           ("restart_s", f"serve, {args.ranks} ranks: kill -9 of a rank to it serving again"))):
            exec_s, fork_s = (statistics.median(r[key] for r in runs if r["mode"] == m) for m in MODES)
            print(f"| {what} | {exec_s:.2f} | {fork_s:.2f} | {exec_s / fork_s:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
