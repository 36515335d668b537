"""Stragglers and standbys on a real server: time per output token before, during and after a
straggler under each --straggler-policy; time to replace an evicted rank from a warm standby
against a cold start; time to scale up by one rank with a standby against a cold start.

    .venv/bin/python benchmarks/straggler.py [--repeats 3] [--json]

Every server: tiny-deepseek-v3, EP 4, `--agent-timeout-s 5 --lease-s 10` (start-up on a loaded
2-core machine can starve the agent thread past the default 1 s), `--streams` clients streaming
greedy completions of `--max-tokens` in a loop. TPOT is the gap between two chunks of one stream.

1. Policies side by side (one server after the other, same load): `--before-s` of steady load,
   then `chaos slow` rank 2 by `--delay-s` per step. "during" runs from the slowdown to the
   eviction (policy evict) or for the same time (off, derate); "after" is the `--after-s` that
   follow. Evict runs with one standby rank and --straggler-evict-after-s `--evict-after-s`.
2. Replacement: the same slowdown with policy evict, with one standby and without; the time from
   the `evict` decision to four ranks serving again (controller clock: event times), `--repeats`
   servers each.
3. Scale-up 4 -> 5 with one standby and without: the controller's `elapsed_s` from the request to
   the new epoch serving, `--repeats` cycles of 4 -> 5 -> 4 on one server each.
Medians (min-max) over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from elastic_ep.harness.load import StreamingLoad
from elastic_ep.harness.server_process import ServerProcess

# a longer agent timeout than the default 1 s: on a shared 2-core machine, worker start-up (torch imports)
# can starve the in-process agent thread that long, which reads as a lost node
BASE = ["--ep-size", "4", "--max-model-len", "256", "--enable-chaos", "--max-ep-size", "5", "--agent-timeout-s", "5",
        "--lease-s", "10"]


def start(args, *flags: str) -> ServerProcess:
    server = ServerProcess(["--model", args.model, *BASE, *flags], Path(tempfile.mkdtemp()) / "serve.log")
    if "--standby-ranks" in flags:
        server.wait_for(lambda c: c["standby"]["ready"], 60, "a standby rank")
    return server


def tpot_ms(load: StreamingLoad, t0: float, t1: float) -> dict[str, float]:
    gaps = np.array([g for t, g in list(load.gaps) if t0 <= t <= t1]) * 1000
    return {"p50": round(float(np.percentile(gaps, 50)), 1), "p99": round(float(np.percentile(gaps, 99)), 1),
            "n": int(gaps.size)} if gaps.size else {"p50": float("nan"), "p99": float("nan"), "n": 0}


def evict_event(cluster: dict) -> dict | None:
    return next((e for e in cluster["events"] if e["kind"] == "straggler" and e["decision"] == "evict"), None)


def replaced_at(cluster: dict) -> float | None:
    """When an epoch of four ranks first formed after the eviction (the replacement may take the
    evicted rank's id: it is the smallest free one)."""
    evicted = evict_event(cluster)["time_s"]
    return min((e["time_s"] for e in cluster["events"] if e["kind"] == "epoch" and e["time_s"] >= evicted
                and len(e["members"]) == 4), default=None)


def straggler_run(args, policy: str, standby: bool, during_s: float | None = None) -> dict:
    """One server: before / during / after a slowdown of rank 2; for evict, the replacement time."""
    flags = ["--straggler-policy", policy, "--straggler-evict-after-s", str(args.evict_after_s)]
    server = start(args, *flags, *(["--standby-ranks", "1"] if standby else []))
    try:
        with StreamingLoad(server.url, args.streams, args.max_tokens) as load:
            time.sleep(args.before_s)
            slowed = time.monotonic()
            server.http.post("/chaos/slow", json={"rank_id": 2, "delay_s": args.delay_s}).raise_for_status()
            replaced_s = None
            if policy == "evict":
                c = server.wait_for(lambda c: evict_event(c) and replaced_at(c) is not None, 120,
                                    "the evicted rank replaced")
                evicted, back = evict_event(c)["time_s"], replaced_at(c)
                replaced_s = round(back - evicted, 3)
                during_end = time.monotonic()
            else:
                time.sleep(during_s or 0.0)
                during_end = time.monotonic()
            time.sleep(args.after_s)
            end = time.monotonic()
        failures = len(load.failures)
        return {"policy": policy, "standby": standby, "before": tpot_ms(load, slowed - args.before_s + 1, slowed),
                "during": tpot_ms(load, slowed, during_end), "after": tpot_ms(load, during_end + 0.5, end),
                "during_s": round(during_end - slowed, 2), "replaced_s": replaced_s, "failures": failures}
    finally:
        server.stop()


def scale_times(args, standby: bool) -> list[float]:
    server = start(args, *(["--standby-ranks", "1"] if standby else []))
    times = []
    try:
        with StreamingLoad(server.url, args.streams, args.max_tokens):
            for _ in range(args.repeats):
                if standby:
                    server.wait_for(lambda c: c["standby"]["ready"], 60, "a standby rank")
                time.sleep(1.0)
                for n in (5, 4):
                    server.http.post("/scale_elastic_ep", json={"new_ep_size": n}).raise_for_status()
                    while (status := server.http.get("/is_scaling_elastic_ep").json())["is_scaling_elastic_ep"]:
                        time.sleep(0.02)
                    if status["scale_phase"] == "failed":
                        raise RuntimeError(status["last_error"])
                    if n == 5:
                        times.append(status["elapsed_s"])
                    server.wait_for(lambda c, n=n: len(c["members"]) == n and c["ready"], 60, f"{n} ranks")
        return times
    finally:
        server.stop()


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--delay-s", type=float, default=0.05)
    parser.add_argument("--evict-after-s", type=float, default=6.0)
    parser.add_argument("--before-s", type=float, default=6.0)
    parser.add_argument("--after-s", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    evict = straggler_run(args, "evict", standby=True)
    runs = [straggler_run(args, p, standby=False, during_s=evict["during_s"]) for p in ("off", "derate")] + [evict]
    replaced = {True: [evict["replaced_s"]], False: []}
    for i in range(args.repeats):
        if i:
            replaced[True].append(straggler_run(args, "evict", standby=True)["replaced_s"])
        replaced[False].append(straggler_run(args, "evict", standby=False)["replaced_s"])
    scale = {standby: scale_times(args, standby) for standby in (True, False)}
    if args.json:
        print(json.dumps({"policies": runs, "replaced_s": {str(k): v for k, v in replaced.items()},
                          "scale_up_s": {str(k): v for k, v in scale.items()}}, indent=1))
        return
    print("| policy | TPOT p50 / p99 before (ms) | during | after | failed requests |")
    print("|---|---|---|---|---|")
    for r in runs:
        cells = [f"{r[w]['p50']} / {r[w]['p99']}" for w in ("before", "during", "after")]
        print(f"| {r['policy']} | " + " | ".join(cells) + f" | {r['failures']} |")
    print(f"\n(during = {evict['during_s']} s: from the slowdown to the evicted rank replaced)\n")
    print("| what | with a standby | cold start |")
    print("|---|---|---|")
    print(f"| evicted rank replaced (evict decision -> 4 ranks serving) | {summary(replaced[True])} | "
          f"{summary(replaced[False])} |")
    print(f"| scale-up 4 -> 5 (request -> serving, controller's elapsed_s) | {summary(scale[True])} | "
          f"{summary(scale[False])} |")


if __name__ == "__main__":
    main()
