"""Recovery: the pause in token flow after `kill -9` and after SIGSTOP of one rank, a full
restart for comparison, the recovery broken down, and the steady-state cost of detection; with
--sizes, the pause after `kill -9` and its breakdown against model size, with and without the
host-memory backup.

    .venv/bin/python benchmarks/recovery.py [--repeats 5] [--model tiny-deepseek-v3]
    .venv/bin/python benchmarks/recovery.py --sizes tiny,0.7GB,2.9GB,4.2GB [--repeats 3]
        [--baseline-src ../main/src]

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

Sizes: the embedded tiny model and checkpoints of issue 16's DeepSeek-V3 shape (`make-tiny
--arch deepseek_v3 --layers 8 --hidden 1024 --experts 64 --top-k 6 --heads 8`, 7 MoE layers),
the expert width setting the size (written once to --cache-dir). EP 4 with the redundant experts
`elastic-ep demo` chooses (3 ranks hold every
expert), --max-num-seqs 8; a backup run starts once the `backup` event says it is complete.
Per repeat: --streams greedy streams of --max-tokens (EOS ignored), SIGKILL of one rank
(rotating) once every stream has --kill-after tokens. "kept" is the pause over the streams that
kept their rank (all but the --streams / 4 with the largest gaps: the scheduler gives each rank
an equal share). Texts are compared with `elastic-ep generate --ignore-eos`. The background
rebalance: its time, its moves' longest epoch change, and the largest gap (less the median) that
ended between the `recovered` and `rebalanced` events. --baseline-src runs every configuration
again with that source tree's code (e.g. main), in the same run; --serve-extra "A;B" runs this
code once per set of extra `serve` flags.
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
import timeit
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.control.config import ServeConfig
from elastic_ep.control.faults.health_rules import adaptive_deadline_s, hung_ranks, lost_heartbeats
from elastic_ep.harness.load import client_for, streams_with_fault
from elastic_ep.harness.server_process import ServerProcess
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.tiny import resolve_model
from elastic_ep.node.exits import exit_code, open_stat
from elastic_ep.placement import choose_redundant_experts
from elastic_ep.runtime.group import ProgressBoard
from elastic_ep.wire import HEALTH_TO_CONTROLLER, ClusterKey, Heartbeat, Inbox, Progress

EP_SIZE = 4
RESTART_DELAY_S = 8.0
# The size sweep's killed rank restarts once the streams are over at every size (48 tokens take
# ~17 s on the 4.2 GB model here), so its rejoin stays out of the pause measured.
SIZED_RESTART_DELAY_S = 30.0
SIZES = {"tiny": 0, "0.7GB": 128, "2.9GB": 512, "4.2GB": 768}  # expert width (moe_intermediate_size)
PARTS = ("detect_s", "fence_s", "rebuild_s", "transfer_s", "verify_s", "recompute_s", "total_s")
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
    heartbeat_interval_s), the agent's exit poll (one /proc read per rank every
    exit_poll_interval_s), and a worker's progress updates (5 per MoE layer)."""
    cfg = ServeConfig(model_dir="", model_name="", ep_size=ranks)
    now = time.monotonic()
    progress = {r: Progress(0, 5, 2, "dispatch", 40, time.time()) for r in range(ranks)}
    seen = {r: now for r in range(ranks)}
    recent = [step_s] * 32

    def check() -> None:
        lost_heartbeats(seen, now, cfg.heartbeat_timeout_s)
        hung_ranks(progress, 0, {40: now}, now,
                   adaptive_deadline_s(recent, cfg.watchdog_multiple, cfg.watchdog_floor_s))

    key = ClusterKey.generate()
    frames = key.seal(Heartbeat(1, 101, progress[1]))
    inbox = Inbox("health", HEALTH_TO_CONTROLLER, key)
    board = ProgressBoard()
    n = 20000
    check_s = timeit.timeit(check, number=n) / n
    beat_s = timeit.timeit(lambda: inbox.read(frames), number=n) / n
    enter_s = timeit.timeit(lambda: board.enter("dispatch", 1), number=n) / n
    stat_fd = open_stat(os.getpid())
    poll_s = timeit.timeit(lambda: exit_code(stat_fd), number=n) / n
    os.close(stat_fd)
    return (check_s * step_s / cfg.health_check_period_s + beat_s * ranks * step_s / cfg.heartbeat_interval_s
            + poll_s * ranks * step_s / cfg.exit_poll_interval_s + enter_s * 5 * moe_layers)


# ---- recovery against model size ------------------------------------------------------------


def checkpoint(size: str, cache_dir: Path) -> str:
    """The model of `size`: the embedded tiny one, or a make-tiny checkpoint written once."""
    if not SIZES[size]:
        return "tiny-deepseek-v3"
    out = cache_dir / f"deepseek-v3-{size}"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "elastic_ep.cli", "make-tiny", "--arch", "deepseek_v3", "--layers", "8",
                        "--hidden", "1024", "--experts", "64", "--top-k", "6", "--heads", "8",
                        "--moe-intermediate", str(SIZES[size]), "--out", str(out)], check=True)
    return str(out)


def reference(model: str, prompts: list[str], max_tokens: int) -> list[str]:
    cmd = [sys.executable, "-m", "elastic_ep.cli", "generate", "--json", "--ignore-eos", "--model", model,
           "--max-tokens", str(max_tokens)]
    for p in prompts:
        cmd += ["--prompt", p]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line)["text"] for line in out.splitlines() if line.strip()]


def sized_serve_args(model: str, backup: bool, extra: list[str]) -> list[str]:
    reader = CheckpointReader(resolve_model(model))
    choice = choose_redundant_experts(reader.config.num_experts, EP_SIZE, len(reader.config.moe_layers),
                                      reader.expert_nbytes)
    return ["--model", model, "--ep-size", str(EP_SIZE), "--redundant-experts", str(choice.redundant_experts),
            "--max-num-seqs", "8", "--restart-delay-s", str(SIZED_RESTART_DELAY_S),
            *([] if backup else ["--no-expert-backup"]),
            *extra]


def sized_kill(server: ServerProcess, victim: int, args, expected: list[str], rebalances: bool) -> dict:
    before = server.wait_full_group(EP_SIZE, timeout_s=300)
    pid = next(r["pid"] for r in before["ranks"] if r["rank_id"] == victim)
    sent: dict[str, float] = {}

    def kill() -> None:
        sent["time_s"] = time.time()
        os.kill(pid, signal.SIGKILL)

    clock = time.time() - time.monotonic()
    results = streams_with_fault(server.url, kill, PROMPTS[: args.streams], args.max_tokens,
                                 after_chunks=args.kill_after, temperature=0, extra_body={"ignore_eos": True})
    last = "rebalanced" if rebalances else "recovered"
    cluster = server.wait_for(lambda c: any(e["kind"] == last and e["time_s"] > sent["time_s"] for e in c["events"]),
                              timeout_s=120, what=f"the {last} event")
    events = [e for e in server.http.get("/cluster", params={"events": 0}).json()["events"]
              if e["time_s"] >= sent["time_s"] - 0.5] or cluster["events"]
    fault = next(e for e in events if e["kind"] == "fault")
    rec = next(e for e in events if e["kind"] == "recovered")
    bal = next((e for e in events if e["kind"] == "rebalanced"), {"time_s": rec["time_s"]})
    moves = [e["epoch_change_s"] for e in events if str(e.get("reason", "")).startswith("recovery: move")]
    normal = statistics.median(g for r in results for g in r.gaps)
    largest = sorted(r.largest_gap for r in results)
    during = [g for r in results for t, g in zip(r.times[1:], r.gaps, strict=True)  # gaps that began after recovery
              if rec["time_s"] < t - g + clock and t + clock <= bal["time_s"]]
    return {
        "victim": victim, "exact": [r.text for r in results] == expected, "normal_gap_s": normal,
        "pause_s": largest[-1] - normal, "pause_kept_s": largest[-1 - args.streams // EP_SIZE] - normal,
        "detect_s": fault["time_s"] - sent["time_s"], "fence_s": rec["detect_to_fence_s"],
        "rebuild_s": rec["rendezvous_s"], "transfer_s": rec["transfer_s"], "verify_s": rec.get("verify_s", 0.0),
        "recompute_s": rec["recompute_s"], "total_s": rec["total_s"],
        "mib": {k: round(v["bytes"] / 2**20, 1) for k, v in rec["transfers"].items() if v["bytes"]},
        "disk_reason": rec.get("disk_reason", ""), "rebalance_s": bal.get("seconds", 0.0),
        "rebalance_mib": round(bal.get("bytes", 0) / 2**20, 1), "move_max_s": max(moves, default=0.0),
        "rebalance_pause_s": max(during, default=normal) - normal,
        "balancedness": bal.get("balancedness", 0.0), "scratch_balancedness": bal.get("scratch_balancedness", 0.0),
    }


def sized_runs(model: str, backup: bool, args, expected: list[str], log: Path, src: str | None,
               extra: list[str]) -> tuple[list[dict], str]:
    """The kills of one configuration, and what failed (a request or a recovery), "" if nothing."""
    env = {"PYTHONPATH": src} if src else None
    server = ServerProcess(sized_serve_args(model, backup, extra), log, ready_timeout_s=900, env=env)
    try:
        written_s = 0.0
        if backup:  # from the first epoch (when the backup is assigned) to the whole file written
            c = server.wait_for(lambda c: any(e["kind"] == "backup" and "holds" in e["message"] for e in c["events"]),
                                timeout_s=600, what="the complete backup")
            start = next(e for e in c["events"] if e["kind"] == "epoch")
            written_s = next(e for e in c["events"] if e["kind"] == "backup")["time_s"] - start["time_s"]
        runs = []
        for i in range(args.repeats):
            try:
                run = {**sized_kill(server, (i + 1) % EP_SIZE, args, expected, rebalances=src is None),
                       "backup_written_s": written_s}
            except Exception as e:  # a failed request or a recovery that never came: the row says so
                print(json.dumps({"model": model, "backup": backup, "code": src or "this", "error": str(e)[:300]}),
                      flush=True)
                return runs, f"kill {i + 1} of {args.repeats}: {type(e).__name__}: {str(e)[:200]}"
            print(json.dumps({"model": model, "backup": backup, "code": src or "this", **run}), flush=True)
            runs.append(run)
        return runs, ""
    finally:
        server.stop()


def sized_row(size: str, backup: bool, code: str, runs: list[dict], failure: str) -> dict:
    if not runs:
        return {"size": size, "backup": backup, "code": code, "failure": failure}
    keys = ("pause_s", "pause_kept_s", "normal_gap_s", *PARTS, "rebalance_s", "rebalance_mib", "move_max_s",
            "rebalance_pause_s", "balancedness", "scratch_balancedness", "backup_written_s")
    mib: dict[str, float] = {}
    for r in runs:
        for k, v in r["mib"].items():
            mib[k] = mib.get(k, 0.0) + v / len(runs)
    return {"size": size, "backup": backup, "code": code, "failure": failure, "exact": all(r["exact"] for r in runs),
            **{k: round(statistics.median(r[k] for r in runs), 4) for k in keys},
            "pause_range_s": [round(min(r["pause_s"] for r in runs), 3), round(max(r["pause_s"] for r in runs), 3)],
            "mib": {k: round(v, 1) for k, v in mib.items()},
            "disk_reasons": sorted({r["disk_reason"] for r in runs if r["disk_reason"]})}


def sized_table(rows: list[dict]) -> str:
    cols = ("model", "backup", "code", "pause s (min-max)", "kept s", "detect", "fence", "rebuild", "transfer",
            "verify", "recompute", "MiB moved", "rebalance s", "move max s", "rebalance pause s", "exact")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "mib" not in r:
            lines.append(f"| {r['size']} | {'on' if r['backup'] else 'off'} | {r['code']} | failed: {r['failure']} |")
            continue
        mib = ", ".join(f"{k} {v:g}" for k, v in r["mib"].items())
        cells = [r["size"], "on" if r["backup"] else "off", r["code"],
                 f"{r['pause_s']:.3f} ({r['pause_range_s'][0]}-{r['pause_range_s'][1]})",
                 *(f"{r[k]:.3f}" for k in ("pause_kept_s", *PARTS[:-1])), mib, f"{r['rebalance_s']:.2f}",
                 f"{r['move_max_s']:.3f}", f"{r['rebalance_pause_s']:.3f}",
                 ("yes" if r["exact"] else "NO") + (f"; then failed: {r['failure']}" if r["failure"] else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_sizes(args) -> None:
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes.split(","):
        model = checkpoint(size, cache)
        expected = reference(model, PROMPTS[: args.streams], args.max_tokens)
        for backup in {"both": (True, False), "on": (True,), "off": (False,)}[args.backup]:
            variants = [(None, v.split()) for v in args.serve_extra.split(";")]
            if args.baseline_src and size in (args.baseline_sizes or args.sizes).split(","):
                variants.append((args.baseline_src, []))
            for i, (src, extra) in enumerate(variants):
                log = cache / f"serve-{size}-{'backup' if backup else 'disk'}-{i}.log"
                runs, failure = sized_runs(model, backup, args, expected, log, src, extra)
                rows.append(sized_row(size, backup, "baseline" if src else " ".join(["this", *extra]), runs, failure))
    print(json.dumps(rows, indent=2))
    print(sized_table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--cost-pairs", type=int, default=12, help="interleaved on/off runs for the steady-state cost")
    parser.add_argument("--sizes", default="", help=f"comma-separated, of {', '.join(SIZES)}: the size sweep only")
    parser.add_argument("--kill-after", type=int, default=16, help="size sweep: tokens per stream before the kill")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "elastic-ep" / "bench"),
                        help="size sweep: where the checkpoints are written")
    parser.add_argument("--baseline-src", default="", help="size sweep: also run each configuration with this "
                        "source tree (its src/ directory), e.g. main's")
    parser.add_argument("--baseline-sizes", default="", help="size sweep: the sizes to run the baseline for "
                        "(default all)")
    parser.add_argument("--serve-extra", default="", help="size sweep: more `serve` flags for this code's servers; "
                        "';' separates variants, each run as a configuration of its own")
    parser.add_argument("--backup", choices=["both", "on", "off"], default="both", help="size sweep: backup runs")
    args = parser.parse_args()
    if args.sizes:
        run_sizes(args)
        return
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
    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

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
