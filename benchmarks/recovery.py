"""Recovery: the pause in token flow after `kill -9` and after SIGSTOP of one rank, a full
restart for comparison, the recovery broken down, and the steady-state cost of detection.

    .venv/bin/python benchmarks/recovery.py [--repeats 5] [--model tiny-deepseek-v3]

One EP 4 server (8 redundant experts, so 3 ranks hold every expert; a dead rank is restarted
after 8 s, once the streams are done, and rejoins between repeats). Each repeat streams `--streams` greedy completions
at once; once every stream has tokens, one rank is killed (or stopped). Pause = the largest gap
between two chunks of any stream, less the median gap of the run. Full restart = stop the
server, start it again, until the first token of a new request. Breakdown per recovery from
the /cluster event: detect (fault event time - signal time), fence, placement, transfers by
source, group rebuild, recompute (the first step of the new epoch). Steady-state cost: mean
decode step wall time (controller side) with heartbeats and watchdog on, over the same with
--no-health-checks, runs interleaved (`--cost-pairs`), and the work detection adds per step
timed part by part. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.control.config import ServeConfig
from elastic_ep.control.health import adaptive_deadline_s, hung_ranks, lost_heartbeats
from elastic_ep.harness.load import client_for, streams_with_fault
from elastic_ep.harness.server_process import ServerProcess
from elastic_ep.runtime.group import ProgressBoard
from elastic_ep.wire import Heartbeat, Progress, decode, encode

EP_SIZE = 4
RESTART_DELAY_S = 8.0
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "1 2 3 4 5",
           "elastic expert parallel", "hello world", "MoE layers route tokens", "a b c d e f"]


def serve_args(model: str, *extra: str) -> list[str]:
    # The dead rank restarts after the streams end, so its rejoin (a process start and an epoch
    # change of its own) does not fall into the pause measured for the fault.
    return ["--model", model, "--ep-size", str(EP_SIZE), "--redundant-experts", "8",
            "--restart-delay-s", str(RESTART_DELAY_S), *extra]


def streams_with_signal(server: ServerProcess, pid: int, sig: int, n: int, max_tokens: int) -> dict[str, float]:
    """Stream n completions; signal `pid` once all have started. Returns pause and normal gap (s)
    and the wall time of the signal."""
    sent: dict[str, float] = {}

    def inject() -> None:
        time.sleep(0.2)
        sent["time_s"] = time.time()
        os.kill(pid, sig)

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    results = streams_with_fault(server.url, inject, prompts, max_tokens, after_chunks=2, temperature=0,
                                 extra_body={"ignore_eos": True})
    gaps = [g for r in results for g in r.gaps]
    normal = statistics.median(gaps)
    return {"pause_s": max(gaps) - normal, "normal_gap_s": normal, "signal_time_s": sent["time_s"]}


def breakdown(server: ServerProcess, since_epoch: int, signal_time_s: float) -> dict:
    """The recovery event after `since_epoch`, with detect time measured from the signal."""
    cluster = server.wait_for(
        lambda c: any(e["kind"] == "recovered" and e.get("epoch", -1) > since_epoch for e in c["events"]),
        timeout_s=30, what="the recovery event",
    )
    event = next(e for e in cluster["events"] if e["kind"] == "recovered" and e["epoch"] > since_epoch)
    fault = next(e for e in cluster["events"] if e["kind"] == "fault" and e["time_s"] >= signal_time_s - 1)
    return {
        "detect_s": fault["time_s"] - signal_time_s,
        "cause": fault["message"],
        "fence_s": event["detect_to_fence_s"],
        "placement_s": event["placement_s"],
        "rebuild_s": event["rendezvous_s"],
        "transfer_s": event["transfer_s"],
        "transfers": event["transfers"],
        "recompute_s": event["recompute_s"],
        "total_s": event["total_s"],
    }


def fault_runs(server: ServerProcess, sig: int, repeats: int, streams: int, max_tokens: int) -> list[dict]:
    runs = []
    for i in range(repeats):
        before = server.wait_full_group(EP_SIZE)
        victim = (i + 1) % EP_SIZE
        result = streams_with_signal(server, server.pids()[victim], sig, streams, max_tokens)
        result.update(breakdown(server, before["epoch"], result.pop("signal_time_s")))
        runs.append(result)
        print(json.dumps({"signal": signal.Signals(sig).name, "victim": victim, **result}), flush=True)
    return runs


def full_restart(server: ServerProcess, args: list[str], log: Path) -> tuple[float, ServerProcess]:
    """Stop everything, serve again, until the first token; returns (seconds, new server)."""
    start = time.monotonic()
    server.stop()
    fresh = ServerProcess(args, log)
    client, model = client_for(fresh.url)
    for _ in client.completions.create(model=model, prompt="hello", max_tokens=4, stream=True):
        break
    return time.monotonic() - start, fresh


def mean_step_s(server: ServerProcess, streams: int, max_tokens: int) -> float:
    """Mean controller-side step wall time over one decode run."""
    def sums() -> tuple[float, float]:
        for family in text_string_to_metric_families(server.http.get("/metrics").text):
            if family.name == "elastic_ep_step_wall_seconds":
                values = {s.name: s.value for s in family.samples}
                return values["elastic_ep_step_wall_seconds_sum"], values["elastic_ep_step_wall_seconds_count"]
        raise KeyError("elastic_ep_step_wall_seconds")

    client, model = client_for(server.url)
    s0, c0 = sums()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda p: client.completions.create(model=model, prompt=p, max_tokens=max_tokens,
                                                          extra_body={"ignore_eos": True}), PROMPTS[:streams]))
    s1, c1 = sums()
    return (s1 - s0) / (c1 - c0)


def detection_work_s(step_s: float, ranks: int = EP_SIZE, moe_layers: int = 3) -> float:
    """The CPU work detection adds to one step of `step_s`, from its parts timed alone: the
    controller's checks (every health_check_period_s) and heartbeat handling (one per rank every
    heartbeat_interval_s), and a worker's progress updates (5 per MoE layer)."""
    cfg = ServeConfig(model_dir="", model_name="", ep_size=ranks)
    now = time.monotonic()
    progress = {r: Progress(0, 5, 2, "dispatch", 40, time.time()) for r in range(ranks)}
    seen = {r: now for r in range(ranks)}
    recent = [step_s] * 32

    def check() -> None:
        lost_heartbeats(seen, now, cfg.heartbeat_timeout_s)
        hung_ranks(progress, 0, {40: now}, now, adaptive_deadline_s(recent, cfg.watchdog_multiple, cfg.watchdog_floor_s))

    frame = encode(Heartbeat(1, 101, progress[1]))
    board = ProgressBoard()
    n = 20000
    check_s = timeit.timeit(check, number=n) / n
    beat_s = timeit.timeit(lambda: decode(frame), number=n) / n
    enter_s = timeit.timeit(lambda: board.enter("dispatch", 1), number=n) / n
    return (check_s * step_s / cfg.health_check_period_s + beat_s * ranks * step_s / cfg.heartbeat_interval_s
            + enter_s * 5 * moe_layers)


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--cost-pairs", type=int, default=12, help="interleaved on/off runs for the steady-state cost")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        server = ServerProcess(serve_args(args.model), logs / "serve.log")
        try:
            kills = fault_runs(server, signal.SIGKILL, args.repeats, args.streams, args.max_tokens)
            hangs = fault_runs(server, signal.SIGSTOP, args.repeats, args.streams, args.max_tokens)
            restarts = []
            for i in range(args.repeats):
                seconds, server = full_restart(server, serve_args(args.model), logs / f"restart{i}.log")
                restarts.append(seconds)
                print(json.dumps({"full_restart_s": seconds}), flush=True)
            server.wait_full_group(EP_SIZE)
            quiet = ServerProcess(serve_args(args.model, "--no-health-checks"), logs / "quiet.log")
            try:
                on, off = [], []
                for _ in range(args.cost_pairs):
                    on.append(mean_step_s(server, args.streams, 64))
                    off.append(mean_step_s(quiet, args.streams, 64))
            finally:
                quiet.stop()
        finally:
            server.stop()
    kill_pause, hang_pause = median(kills, "pause_s"), median(hangs, "pause_s")
    restart_s = statistics.median(restarts)
    cost = statistics.median(a / b for a, b in zip(on, off, strict=True)) - 1
    spread = statistics.quantiles([a / b - 1 for a, b in zip(on, off, strict=True)], n=4)
    summary = {
        "kill_pause_s": kill_pause, "hang_pause_s": hang_pause, "full_restart_s": restart_s,
        "restart_over_kill_pause": restart_s / kill_pause, "steady_state_cost": cost,
        "steady_state_cost_quartiles": [spread[0], spread[2]],
        "step_s_with_health": statistics.median(on), "step_s_without": statistics.median(off),
        "detection_work_share_of_step": detection_work_s(statistics.median(on)) / statistics.median(on),
        "kill_breakdown": {k: median(kills, k) for k in
                           ("detect_s", "fence_s", "placement_s", "rebuild_s", "transfer_s", "recompute_s", "total_s")},
        "hang_breakdown": {k: median(hangs, k) for k in
                           ("detect_s", "fence_s", "placement_s", "rebuild_s", "transfer_s", "recompute_s", "total_s")},
        "kill_transfers_example": kills[0]["transfers"],
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
