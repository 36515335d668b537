"""Faults across hosts on the network test bed (three namespace hosts, elastic_ep.harness.netns):
host A runs the controller alone, hosts B and C two ranks each. Under six streaming clients:

- host loss (every process of C SIGKILLed): the largest pause a client saw, and the recovery's
  own figure (detection to serving again);
- link cut (C alive but unreachable): the same, then the time from healing the link to four ranks
  serving again (C's agent fenced itself when its lease ran out and registers again);

for each --agent-timeout-s (the controller gives up on a silent node; --heartbeat-timeout-s is
set equal) and --lease-s given. Needs root.

    .venv/bin/python benchmarks/multihost.py [--timeouts 1.0,0.5] [--lease-s 3] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_ep.harness.load import PROMPTS, streams_with_fault
from elastic_ep.harness.netns import TestBed
from elastic_ep.harness.server_process import ServerProcess


def start(bed: TestBed, timeout_s: float, lease_s: float, logs: Path) -> ServerProcess:
    a, b, c = bed.hosts
    server = ServerProcess(
        ["--model", "tiny-deepseek-v3", "--ep-size", "4", "--local-ranks", "0", "--redundant-experts", "16",
         "--restart-delay-s", "-1", "--agent-timeout-s", str(timeout_s), "--heartbeat-timeout-s", str(timeout_s),
         "--lease-s", str(lease_s)], logs / "serve.log", None, host=a.addr, port=8000, popen=a.popen)
    for name, host in (("hostB", b), ("hostC", c)):
        start_agent(host, name, server, lease_s, logs, "initial")
    server.wait_ready(180)
    server.wait_full_group(4, 120)
    return server


def start_agent(host, name: str, server: ServerProcess, lease_s: float, logs: Path, join_mode: str) -> None:
    host.popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--controller", server.controller_addr(), "--node",
                name, "--cluster-key-file", str(server.key_file), "--ranks", "2", "--lease-s", str(lease_s),
                "--join-mode", join_mode],
               stdout=open(logs / f"{name}.log", "a"), stderr=subprocess.STDOUT)  # noqa: SIM115


def fault_run(server: ServerProcess, inject) -> dict:
    """Pause and recovery figures of one fault injected once every stream has two chunks."""
    last = server.cluster()["events"][-1]["id"]
    try:
        results = streams_with_fault(server.url, inject, PROMPTS, 48, after_chunks=2, temperature=0,
                                     extra_body={"ignore_eos": True})
    except Exception:
        for e in server.http.get("/cluster", params={"since": last, "events": 0}).json()["events"]:
            print(f"{e['kind']:>14} {e['rank_id']!s:>4} {e['message'][:200]}", file=sys.stderr)
        raise
    gaps = [g for r in results for g in r.gaps]
    state = server.wait_for(lambda s: any(e["kind"] == "recovered" and e["id"] > last for e in s["events"]),
                            timeout_s=60, what="the recovery")
    recovered = next(e for e in state["events"] if e["kind"] == "recovered" and e["id"] > last)
    return {"pause_s": round(max(gaps) - statistics.median(gaps), 3), "recovery_s": recovered["total_s"]}


def measure(timeout_s: float, lease_s: float, repeats: int) -> dict:
    logs = Path(tempfile.mkdtemp(prefix="multihost-"))
    loss, cut, heal = [], [], []
    with TestBed(3) as bed:
        server = start(bed, timeout_s, lease_s, logs)
        c = bed.hosts[2]
        try:
            for _ in range(repeats):
                cut.append(fault_run(server, c.cut))
                time.sleep(lease_s + 0.5)  # C fences itself meanwhile
                t0 = time.monotonic()
                c.heal()
                server.wait_full_group(4, 120)
                heal.append(round(time.monotonic() - t0, 3))
                loss.append(fault_run(server, c.lose))
                start_agent(c, "hostC", server, lease_s, logs, "recover")
                server.wait_full_group(4, 120)
        finally:
            server.stop()

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {"agent_timeout_s": timeout_s, "lease_s": lease_s,
            "host_loss": {"pause_s": med(loss, "pause_s"), "recovery_s": med(loss, "recovery_s")},
            "link_cut": {"pause_s": med(cut, "pause_s"), "recovery_s": med(cut, "recovery_s")},
            "heal_to_full_size_s": statistics.median(heal), "runs": {"loss": loss, "cut": cut, "heal": heal}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeouts", default="1.0,0.5", help="agent (and heartbeat) timeouts to compare, s")
    parser.add_argument("--lease-s", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [measure(float(t), args.lease_s, args.repeats) for t in args.timeouts.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'agent timeout':>13} {'lease':>6} {'loss pause':>11} {'loss recov.':>12} {'cut pause':>10} "
          f"{'cut recov.':>11} {'heal->full':>11}")
    for r in rows:
        print(f"{r['agent_timeout_s']:>12g}s {r['lease_s']:>5g}s {r['host_loss']['pause_s']:>10.2f}s "
              f"{r['host_loss']['recovery_s']:>11.2f}s {r['link_cut']['pause_s']:>9.2f}s "
              f"{r['link_cut']['recovery_s']:>10.2f}s {r['heal_to_full_size_s']:>10.2f}s")


if __name__ == "__main__":
    main()
