"""How long a `serve` process takes to end after SIGTERM, side by side: `python -m elastic_ep.cli`
(ends without the interpreter's teardown, cli.py: exit_without_teardown) against the same `main`
run as the console script does (`sys.exit(main())`: the interpreter's teardown and last garbage
collection). A 2-rank tiny server, one request served, then stopped; pairs alternate.

    .venv/bin/python benchmarks/server_stop.py [--pairs 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from elastic_ep.harness.server_process import ServerProcess

AS_CONSOLE_SCRIPT = "import sys; from elastic_ep.cli import main; sys.argv[0] = 'elastic-ep'; sys.exit(main())"


def console_script_popen(argv: list[str], **kwargs) -> subprocess.Popen:
    """`python -m elastic_ep.cli ARGS` run as `elastic-ep ARGS` is: main() under sys.exit."""
    assert argv[1:3] == ["-m", "elastic_ep.cli"], argv
    return subprocess.Popen([argv[0], "-c", AS_CONSOLE_SCRIPT, *argv[3:]], **kwargs)


def stop_seconds(popen, log_dir: Path) -> float:
    server = ServerProcess(["--model", "tiny-deepseek-v3", "--ep-size", "2"], log_dir / "serve.log", popen=popen)
    server.wait_full_group(2)
    server.http.post("/v1/completions", json={"model": "tiny-deepseek-v3", "prompt": "hi", "max_tokens": 4})
    t0 = time.monotonic()
    server.stop()
    assert server.proc.returncode == 0, server.log()[-2000:]
    return time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    fast, teardown = [], []
    for _ in range(args.pairs):
        with tempfile.TemporaryDirectory() as d:
            fast.append(stop_seconds(subprocess.Popen, Path(d)))
        with tempfile.TemporaryDirectory() as d:
            teardown.append(stop_seconds(console_script_popen, Path(d)))
    print(f"stop after SIGTERM, s: -m elastic_ep.cli {[round(s, 2) for s in fast]} (median "
          f"{statistics.median(fast):.2f}); as the console script {[round(s, 2) for s in teardown]} (median "
          f"{statistics.median(teardown):.2f})")


if __name__ == "__main__":
    main()
