"""`elastic-ep serve` from its start to GET /ready answering 200, and from SIGTERM to its exit, for
this tree and a baseline revision side by side: the trees alternate, their order swapped every
round. Each start is a tiny DeepSeek-V3 on `--ranks` local ranks forked from the node's zygote (the
default), one completion served before the stop.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_start.py --baseline REV [--ranks 2] [--rounds 5]
        [--bytecode none|both]

`--bytecode both` (the default) compiles both trees' bytecode first, as `make test` and `make demo`
do (the Makefile's `bytecode`); `none` removes it from both, as a checkout run without `make` has it
where PYTHONDONTWRITEBYTECODE is set (this machine, CI). The baseline is `git archive REV src`
in a temporary directory, run with PYTHONPATH there.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_ep.harness.server_process import ServerProcess

REPO = Path(__file__).resolve().parent.parent


def once(src: Path, ranks: int, log: Path) -> tuple[float, float]:
    """(start to ready s, SIGTERM to exit s) of one server run from the package in `src`."""
    t0 = time.monotonic()
    server = ServerProcess(["--model", "tiny-deepseek-v3", "--ep-size", str(ranks)], log,
                           env={"PYTHONPATH": str(src)})
    ready_s = time.monotonic() - t0
    done = server.http.post("/v1/completions", json={"model": "tiny-deepseek-v3", "prompt": "hi", "max_tokens": 4})
    assert done.status_code == 200, done.text
    t1 = time.monotonic()
    server.stop()
    assert server.proc.returncode == 0, server.log()[-2000:]
    return ready_s, time.monotonic() - t1


def bytecode(src: Path, on: bool) -> None:
    for cache in src.rglob("__pycache__"):
        shutil.rmtree(cache)
    if on:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, metavar="REV")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bytecode", choices=["both", "none"], default="both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "src"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        trees = {args.baseline: Path(tmp) / "src", "this tree": REPO / "src"}
        for src in trees.values():
            bytecode(src, args.bytecode == "both")
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                times[name].append(once(trees[name], args.ranks, Path(tmp) / f"serve-{r}.log"))
    print(f"{args.ranks} ranks, {args.rounds} rounds, bytecode {args.bytecode}")
    print("| tree | start to ready s (median; each) | SIGTERM to exit s (median; each) |")
    print("|---|---|---|")
    for name, runs in times.items():
        ready, stop = [r for r, _ in runs], [s for _, s in runs]
        print(f"| {name} | {statistics.median(ready):.2f}; {', '.join(f'{x:.2f}' for x in ready)} | "
              f"{statistics.median(stop):.2f}; {', '.join(f'{x:.2f}' for x in stop)} |")


if __name__ == "__main__":
    main()
