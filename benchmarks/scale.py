"""Online scaling under load: time from POST /scale_elastic_ep to the new size serving (4 -> 6,
6 -> 4), requests failed (must be 0), and the time per output token (TPOT, the gap between two
chunks of one stream) during the scale against before it.

    .venv/bin/python benchmarks/scale.py [--repeats 3] [--model tiny-deepseek-v3] [--json]

One EP 4 server (16 redundant experts: 8 slots per rank, so 2 ranks hold every expert;
--max-ep-size 6). `--streams` clients stream greedy completions of `--max-tokens` in a loop the
whole time. Per repeat: `--before-s` seconds of steady load, then 4 -> 6 and, once that serves,
6 -> 4. "Time to serve" is measured by the client (request sent to GET /is_scaling_elastic_ep
saying done with the new size serving); the controller's own figure (`elapsed_s`) is reported
too, and "settled" (every leaving process stopped and gone from /cluster). TPOT before = chunk gaps in the
`--before-s` window; during = chunk gaps that arrived
between the request and the new size serving. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from elastic_ep.harness.load import StreamingLoad
from elastic_ep.harness.server_process import ServerProcess


def scale_to(server: ServerProcess, n: int, timeout_s: float = 120.0) -> tuple[float, float, float, float]:
    """POST the scale, wait until done; returns (start, serving, controller's elapsed_s, settled):
    serving = the new epoch serves; settled = also every leaving process gone from /cluster."""
    start = time.monotonic()
    reply = server.http.post("/scale_elastic_ep", json={"new_ep_size": n})
    reply.raise_for_status()
    while time.monotonic() - start < timeout_s:
        status = server.http.get("/is_scaling_elastic_ep").json()
        if not status["is_scaling_elastic_ep"]:
            if status["scale_phase"] == "failed":
                raise RuntimeError(f"scale to {n} failed: {status['last_error']}")
            serving = time.monotonic()
            server.wait_full_group(n)
            return start, serving, status["elapsed_s"], time.monotonic()
        time.sleep(0.02)
    raise TimeoutError(f"scale to {n} not done within {timeout_s}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--before-s", type=float, default=4.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = ServerProcess(["--model", args.model, "--ep-size", "4", "--redundant-experts", "16",
                            "--max-ep-size", "6", "--scale-drain-timeout-s", "2"], log)
    rows: dict[str, list[dict]] = {"4 -> 6": [], "6 -> 4": []}
    try:
        streams = StreamingLoad(server.url, args.streams, args.max_tokens).start()
        for _ in range(args.repeats):
            t_before = time.monotonic()
            time.sleep(args.before_s)
            before = streams.window_p99_ms(t_before, time.monotonic())
            for name, n in (("4 -> 6", 6), ("6 -> 4", 4)):
                start, end, elapsed_s, settled = scale_to(server, n)
                rows[name].append({"serve_s": round(end - start, 3), "controller_s": elapsed_s,
                                   "settled_s": round(settled - start, 3),
                                   "tpot_p99_before_ms": before,
                                   "tpot_p99_during_ms": streams.window_p99_ms(start, end)})
                time.sleep(1.0)
        streams.stop()
    finally:
        server.stop()
    summary = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"runs": runs}
        for name, runs in rows.items()
    }
    summary["requests"] = {"finished": streams.done, "failed": len(streams.failures), "errors": streams.failures[:5]}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{'scale':8} {'to serving (client)':>20} {'controller':>11} {'settled':>8} {'TPOT p99 before':>16} "
          f"{'during':>8}")
    for name in rows:
        s = summary[name]
        print(f"{name:8} {s['serve_s']:>19.2f}s {s['controller_s']:>10.2f}s {s['settled_s']:>7.2f}s "
              f"{s['tpot_p99_before_ms']:>14.1f}ms {s['tpot_p99_during_ms']:>6.1f}ms")
    print(f"requests finished {streams.done}, failed {len(streams.failures)}")


if __name__ == "__main__":
    main()
