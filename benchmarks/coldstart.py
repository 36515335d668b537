"""Cold start: time to ready against the number of ranks, with and without read once, copy many,
under a storage throttle; and wake (from sleep) to first token against a cold start.

    PYTHONPATH=src .venv/bin/python benchmarks/coldstart.py [--ranks 2,4] [--rate-mb-s 50] [--model DIR]

One node (the agent inside `elastic-ep serve`). The model: --model, else the checkpoint of
tests/e2e/test_cold_start.py (DeepSeek-V3-shaped, 64 experts of 3 x 512 x 256 in 3 MoE layers,
~330 MB in float32), written once to --cache-dir. Every start runs under
--load-read-rate-mb-s (all the processes of this machine share that rate, as ranks share one
storage), with the redundant experts serve chooses (auto), the readiness gate on and
--agent-timeout-s 10 (on this loaded machine the in-process agent was seen silent for the default
1 s while ranks started). Per (ranks, mode): the seconds from
the server process's start to /ready and to the first token of a greedy request, the
server's own time to ready and its parts (/cluster `cold_start`), and the bytes read from storage
and copied from shared memory. Modes: "read once" (default serve) and "per rank"
(--no-read-once: every rank reads its dense weights and experts itself, the agent reads its
backup after the first epoch as before). Then, on the last read-once server: POST /sleep at level 1
and 2, POST /wake_up, and the seconds from the wake request to the first token of a request,
against the cold start's process start to first token.

The fault check of issue 28, `--repeat N`: N cold starts one after another with serve's defaults
(no throttle, default deadlines), each to /ready and a first token, counting the fault, fencing,
degraded, node-lost and epoch-failed events of each start and the ranks fenced; exits 1 when any
start had one. `--shape issue` is the issue's 2.9 GB DeepSeek-V3 shape (8 layers, hidden 1024, 64
experts of 512, top-6), where one start in four once fenced two loading ranks:

    PYTHONPATH=src .venv/bin/python benchmarks/coldstart.py --repeat 4 --shape issue --ranks 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_ep.harness.server_process import ServerProcess

SHAPE = ("--arch", "deepseek_v3", "--layers", "4", "--hidden", "512", "--experts", "64", "--top-k", "6",
         "--heads", "8", "--moe-intermediate", "256")
# issue 28's checkpoint: 8 layers (7 MoE) of 64 experts of 3 x 1024 x 512 float32, about 2.9 GB
ISSUE_SHAPE = ("--arch", "deepseek_v3", "--layers", "8", "--hidden", "1024", "--experts", "64", "--top-k", "6",
               "--heads", "8", "--moe-intermediate", "512")
SHAPES = {"test": ("coldstart-deepseek-v3", SHAPE), "issue": ("coldstart-deepseek-v3-issue28", ISSUE_SHAPE)}
PROMPT = "The capital of France is"
# what a start that starved a loading rank shows in its events
FAULT_KINDS = ("fault", "fencing", "degraded", "node-lost", "epoch-failed")


def model_dir(args) -> Path:
    if args.model:
        return Path(args.model)
    name, shape = SHAPES[args.shape]
    out = Path(args.cache_dir) / name
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "elastic_ep.cli", "make-tiny", *shape, "--out", str(out)], check=True)
    return out


def first_token_s(server: ServerProcess, model: str) -> float:
    """Seconds until the first streamed chunk of a greedy request (read to its end: a sleep
    after it finds no request running)."""
    t0, first = time.monotonic(), None
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and "choices" in line:
                first = time.monotonic() - t0
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def cold_start(model: Path, ranks: int, read_once: bool, rate: float, log: Path) -> tuple[dict, ServerProcess]:
    flags = ["--model", str(model), "--ep-size", str(ranks), "--restart-delay-s", "-1",
             "--load-read-rate-mb-s", str(rate), "--startup-timeout-s", "600", "--epoch-timeout-s", "600",
             "--agent-timeout-s", "10",
             *([] if read_once else ["--no-read-once"])]
    t0 = time.monotonic()
    server = ServerProcess(flags, log, ready_timeout_s=900)
    ready_s = time.monotonic() - t0
    token_s = ready_s + first_token_s(server, str(model))
    cold = server.cluster()["cold_start"]
    node = cold["bytes"]["node0"]
    return {"ranks": ranks, "mode": "read once" if read_once else "per rank", "ready_s": round(ready_s, 2),
            "first_token_s": round(token_s, 2), "server_time_to_ready_s": cold["time_to_ready_s"],
            "parts": cold["parts"], "storage_mb": round(node["storage"] / 1e6, 1),
            "shared_memory_mb": round(node["shared_memory"] / 1e6, 1)}, server


def wake_to_first_token(server: ServerProcess, model: str, level: int) -> dict:
    asleep = server.http.post("/sleep", params={"level": level}, timeout=300)
    if asleep.status_code != 200:  # e.g. a fault ended the sleep: said, not timed
        return {"level": level, "error": f"{asleep.status_code} {asleep.text[:200]}"}
    t0 = time.monotonic()
    server.http.post("/wake_up", timeout=300).raise_for_status()
    woke_s = time.monotonic() - t0
    return {"level": level, "wake_s": round(woke_s, 3), "wake_to_first_token_s": round(woke_s + first_token_s(
        server, model), 3)}


def repeated_start(model: Path, ranks: int, start: int, log: Path) -> dict:
    """One cold start with serve's defaults, to /ready and a first token; its fault events and
    fenced ranks (a start that never got ready says why)."""
    t0 = time.monotonic()
    server = ServerProcess(["--model", str(model), "--ep-size", str(ranks), "--restart-delay-s", "-1",
                            "--startup-timeout-s", "900", "--epoch-timeout-s", "900"], log, ready_timeout_s=None)
    try:
        row: dict = {"start": start, "ranks": ranks}
        try:
            server.wait_ready(1200)
            row["ready_s"] = round(time.monotonic() - t0, 2)
            row["first_token_s"] = round(row["ready_s"] + first_token_s(server, str(model)), 2)
        except (TimeoutError, RuntimeError) as e:
            row["error"] = str(e).splitlines()[0]
        events = server.http.get("/cluster", params={"events": 0}).json()["events"]
        faults = [e for e in events if e["kind"] in FAULT_KINDS]
        row["faults"] = len(faults)
        # the ranks a fault named: each was fenced (killed) by the recovery that followed
        row["fenced_ranks"] = sorted({e["rank_id"] for e in faults if e["kind"] == "fault"})
        row["fault_messages"] = [e["message"] for e in faults][:4]
        return row
    finally:
        server.stop()


def repeat_check(model: Path, ranks: int, repeat: int, logs: Path, as_json: bool) -> int:
    """`--repeat`: `repeat` cold starts; 1 when any of them faulted or did not get ready."""
    rows = []
    for i in range(repeat):
        rows.append(repeated_start(model, ranks, i, logs / f"serve-repeat-{i}.log"))
        print(json.dumps(rows[-1]), file=sys.stderr if not as_json else sys.stdout, flush=True)
    bad = [r for r in rows if r["faults"] or "error" in r]
    if not as_json:
        size_gb = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e9
        ready = [r["ready_s"] for r in rows if "ready_s" in r]
        print(f"model {model} ({size_gb:.2f} GB), {ranks} ranks, serve's defaults: {repeat} cold starts, "
              f"{len(bad)} with a fault or not ready; ranks fenced: {sum(len(r['fenced_ranks']) for r in rows)}; "
              f"ready in {min(ready, default=0):.1f}-{max(ready, default=0):.1f} s (logs in {logs})")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--rate-mb-s", type=float, default=50.0, help="--load-read-rate-mb-s of every start")
    parser.add_argument("--model", default="", help="a checkpoint directory (default: the test's, made once)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "elastic-ep"))
    parser.add_argument("--json", action="store_true", help="one JSON line per result")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="test",
                        help="the checkpoint made when --model is not given: the cold-start test's (330 MB) or "
                             "issue 28's (2.9 GB)")
    parser.add_argument("--repeat", type=int, default=0,
                        help="the fault check instead: this many cold starts at the first of --ranks with serve's "
                             "defaults, counting faults and fenced ranks (exit 1 when any start had one)")
    args = parser.parse_args(argv)
    model = model_dir(args)
    logs = Path(tempfile.mkdtemp(prefix="bench-coldstart-"))
    if args.repeat > 0:
        return repeat_check(model, int(args.ranks.split(",")[0]), args.repeat, logs, args.json)
    configs = [(int(r), read_once) for r in args.ranks.split(",") for read_once in (False, True)]
    rows = []
    for ranks, read_once in configs:
        row, server = cold_start(model, ranks, read_once, args.rate_mb_s, logs / f"serve-{ranks}-{read_once}.log")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # kept if a later part fails
        if (ranks, read_once) != configs[-1]:
            server.stop()
    cold_row = rows[-1]  # the last server (read once) stays up: its sleep and wake against its cold start
    try:
        wakes = [wake_to_first_token(server, str(model), level) for level in (1, 2)]
    finally:
        server.stop()
    if args.json:
        for item in rows + wakes:
            print(json.dumps(item))
        return 0
    print(f"model {model} under --load-read-rate-mb-s {args.rate_mb_s:g} (shared by every process of this host)")
    print(f"{'ranks':>5} {'mode':<9} {'ready s':>8} {'1st token s':>11} {'storage MB':>10} {'shm MB':>8}  parts")
    by = {(r["ranks"], r["mode"]): r for r in rows}
    for r in rows:
        print(f"{r['ranks']:>5} {r['mode']:<9} {r['ready_s']:>8.2f} {r['first_token_s']:>11.2f} "
              f"{r['storage_mb']:>10.1f} {r['shared_memory_mb']:>8.1f}  {r['parts']}")
    for ranks in sorted({r["ranks"] for r in rows}):
        slow, fast = by[(ranks, "per rank")], by[(ranks, "read once")]
        print(f"{ranks} ranks: read once is {slow['ready_s'] / fast['ready_s']:.2f}x faster to ready, reads "
              f"{slow['storage_mb'] / fast['storage_mb']:.2f}x less from storage")
    for w in wakes:
        if "error" in w:
            print(f"sleep at level {w['level']} failed: {w['error']}")
            continue
        print(f"wake from level {w['level']}: first token {w['wake_to_first_token_s']:.3f}s after POST /wake_up "
              f"({w['wake_s']:.3f}s the wake itself) vs {cold_row['first_token_s']:.2f}s from a cold start of "
              f"{cold_row['ranks']} ranks: {cold_row['first_token_s'] / w['wake_to_first_token_s']:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
