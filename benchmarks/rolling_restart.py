"""Rolling restart under load: time per rank replaced, with a standby taking each member's place
(`surge`) against each member restarted in place (`restart`), side by side in one run; the whole
rollout's time, requests failed (must be 0), and the time per output token (TPOT p99, the gap
between two chunks of one stream) during the rollout against before it.

    .venv/bin/python benchmarks/rolling_restart.py [--model tiny-deepseek-v3] [--json]

Two EP 3 servers one after the other (16 experts + 8 redundant: 8 slots per rank, so 2 ranks
hold every expert): one with --standby-ranks 0, one with --standby-ranks 1. `--streams` clients
stream greedy completions of `--max-tokens` in a loop the whole time; after `--before-s` of
steady load, POST /rolling_restart (no new options) and wait until GET /rolling_restart says done.
"Per rank" is the controller's `took_s` of each replaced member (from its first step to its
last: drain, stop, start and rejoin, or take the standby, drain and stop); the standby's own
replacement (retire it, a new one starts in the background) is left out of the per-rank figure.
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


def whole(cluster: dict, standbys: int) -> bool:
    return (cluster["ready"] and len(cluster["members"]) == 3 and len(cluster["standby"]["ready"]) == standbys
            and not cluster["rollout"].get("active"))


def one_rollout(model: str, standbys: int, streams_n: int, max_tokens: int, before_s: float) -> dict:
    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = ServerProcess(["--model", model, "--ep-size", "3", "--redundant-experts", "8", "--local-ranks", "4",
                            "--standby-ranks", str(standbys), "--scale-drain-timeout-s", "1"], log)
    try:
        server.wait_for(lambda c: whole(c, standbys), timeout_s=120, what="the group and its standbys")
        streams = StreamingLoad(server.url, streams_n, max_tokens).start()
        t_before = time.monotonic()
        time.sleep(before_s)
        before = streams.window_p99_ms(t_before, time.monotonic())
        start = time.monotonic()
        server.http.post("/rolling_restart", json={}).raise_for_status()
        while (view := server.http.get("/rolling_restart").json())["active"]:
            time.sleep(0.1)
        end = time.monotonic()
        during = streams.window_p99_ms(start, end)
        streams.stop()
    finally:
        server.stop()
    if view["state"] != "done":
        raise RuntimeError(f"the rollout ended {view['state']}: {view.get('error')}")
    members = [r for r in view["replaced"] if r["plan"] != "standby"]
    return {"standby_ranks": standbys, "rollout_s": round(end - start, 3),
            "per_rank_s": statistics.median(r["took_s"] for r in members),
            "per_rank_range_s": [min(r["took_s"] for r in members), max(r["took_s"] for r in members)],
            "plans": [r["plan"] for r in view["replaced"]],
            "tpot_p99_before_ms": before, "tpot_p99_during_ms": during,
            "finished": streams.done, "failed": len(streams.failures), "errors": streams.failures[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--before-s", type=float, default=4.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [one_rollout(args.model, k, args.streams, args.max_tokens, args.before_s) for k in (0, 1)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'--standby-ranks':>15} {'plans':>36} {'per rank':>9} {'range':>13} {'rollout':>8} "
          f"{'TPOT p99 before':>16} {'during':>8} {'failed':>6}")
    for r in rows:
        lo, hi = r["per_rank_range_s"]
        print(f"{r['standby_ranks']:>15} {','.join(r['plans']):>36} {r['per_rank_s']:>8.2f}s {lo:>5.2f}-{hi:<5.2f}s "
              f"{r['rollout_s']:>7.2f}s {r['tpot_p99_before_ms']:>14.1f}ms {r['tpot_p99_during_ms']:>6.1f}ms "
              f"{r['failed']:>6}")
    print(f"per rank, restart in place / with a standby: {rows[0]['per_rank_s'] / rows[1]['per_rank_s']:.2f}x")


if __name__ == "__main__":
    main()
