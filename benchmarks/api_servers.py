"""HTTP in the controller's process against N API server processes (`serve --api-server-count`),
side by side: the same model and load on two servers alive at once, runs interleaved.

    .venv/bin/python benchmarks/api_servers.py [--count 2] [--concurrency 32] [--max-tokens 64] [--repeats 3]

Per run: `concurrency` greedy streams with ignore_eos. Reported per server (medians over the
repeats): output tokens/s, chunk-gap p50 / p99, and CPU seconds per 1,000 output tokens of the
controller's process (the control thread, and with N = 1 the HTTP event loop too) and of the API
server processes (their sum; none with N = 1). The ranks' CPU is in neither. The load's clients
run on the same cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import psutil

from elastic_ep.harness.server_process import ServerProcess
from serve import stream_load  # benchmarks/serve.py


def api_server_pids(server: ServerProcess) -> list[int]:
    return [c.pid for c in psutil.Process(server.proc.pid).children()
            if "elastic_ep.commands.api_server" in c.cmdline()]


def cpu_s(pids: list[int]) -> float:
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def run_once(server: ServerProcess, concurrency: int, max_tokens: int) -> dict[str, float]:
    servers = api_server_pids(server)
    before = cpu_s([server.proc.pid]), cpu_s(servers)
    result = stream_load(server, concurrency, max_tokens)
    tokens = result["output_tokens_per_s"] * result["wall_s"]
    after = cpu_s([server.proc.pid]), cpu_s(servers)
    return {**result, "controller_cpu_s_per_1k_tokens": (after[0] - before[0]) / tokens * 1000,
            "api_servers_cpu_s_per_1k_tokens": (after[1] - before[1]) / tokens * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--count", type=int, default=2, help="API server processes of the second server")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-api-servers-"))
    common = ["--model", args.model, "--ep-size", str(args.ep_size), "--redundant-experts", "0",
              "--max-num-seqs", str(args.concurrency)]
    servers = {n: ServerProcess([*common, "--api-server-count", str(n)], log_dir / f"serve-{n}.log", 300)
               for n in (1, args.count)}
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in servers}
    try:
        for server in servers.values():
            stream_load(server, args.concurrency, 8)  # warm-up
        for _ in range(args.repeats):
            for n, server in servers.items():
                runs[n].append(run_once(server, args.concurrency, args.max_tokens))
    finally:
        for server in servers.values():
            server.stop()
    table = {n: {k: float(np.median([r[k] for r in rs])) for k in rs[0] if k != "wall_s"} for n, rs in runs.items()}
    if args.json:
        print(json.dumps(table, indent=2))
        return
    keys = list(next(iter(table.values())))
    print(f"{'api servers':>12} " + " ".join(f"{k:>32}" for k in keys))
    for n, row in table.items():
        print(f"{n:>12} " + " ".join(f"{row[k]:>32.3f}" for k in keys))


if __name__ == "__main__":
    main()
