"""The controller group's cost on the step loop, and a takeover's breakdown.

    PYTHONPATH=src .venv/bin/python benchmarks/ha.py [--seconds 20] [--repeats 2] [--threads 8] [--json]
        [--only takeover|outage|step] [--journal-via etcd|direct]

Three deployments of the tiny model (--ep-size 2, both ranks under one separate `elastic-ep agent`
process, so only the group differs), run in turn `--repeats` times under the same streaming load
(`--threads` clients, greedy, 64 tokens): `alone` (`serve --local-ranks 0` + `agent --controller`:
no group), `etcd` (a real etcd, `serve --etcd --ha-group` leading with one standby, `agent --etcd`,
the journal through etcd) and `direct` (the same with `--ha-journal-via direct`: the leader streams
the journal to the standby). Everything runs on this one machine: etcd and the standby take CPU
from the workers here, which they would not on hosts of their own.
Per run: the mean step wall time at the controller (elastic_ep_step_wall_seconds, plan sent to last
result), tokens/s delivered, and in the group the journal batches shipped and the standby's lag.
First, in this process, what the journal costs where it runs, in CPU time of the paying thread
(not disturbed by a loaded machine as wall time is): `add` per event (the HTTP thread, per token
of each request) and one batch of 64 entries shipped by the journal thread (once per
--ha-journal-flush-s), to a real etcd and, directly, to one standby following over loopback.
`--only step` runs just that and the three deployments. Then, once, the takeover: SIGKILL of the
leader's process; the times from the kill to the standby leading (the lease running out plus a
campaign tick), to its controller up, to the agent registered with it naming its running ranks,
to those ranks registered (adopted), to the epoch that adopts them formed (/ready), and whether
the ranks kept their processes (`--journal-via` chooses the group's journal for it).
Last, etcd unreachable for longer than the lease (`outage`: etcd SIGSTOPped for --ha-lease-s + 2 s
under streaming load through the router, the agent on `--lease-s 20`): /health of both controllers polled every
20 ms: the most that ever answered "leader" at once, when the leader deposed itself (exit code 3),
when the standby led after etcd came back, when it was ready, whether the ranks kept their
processes, how many new requests the router refused meanwhile (503 with Retry-After: nothing is
ready), and any other failure. `--only` runs just one of the two scenarios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from elastic_ep.group.journal import Admitted, Delivered, JournalWriter, LeaderJournal
from elastic_ep.group.journal_stream import DirectJournalWriter, JournalFollower, bind_journal_socket
from elastic_ep.group.store import GroupStore, Seat
from elastic_ep.harness.etcd import EtcdProcess
from elastic_ep.harness.load import StreamingLoad
from elastic_ep.harness.router_process import RouterProcess
from elastic_ep.harness.server_process import ServerProcess, terminate
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.wire import ClusterKey

MODEL = ["--model", "tiny-deepseek-v3", "--ep-size", "2", "--max-model-len", "512", "--local-ranks", "0"]


def histogram_mean(metrics: str, name: str) -> tuple[float, float]:
    """(sum, count) of an unlabelled histogram in Prometheus text."""
    total = count = 0.0
    for line in metrics.splitlines():
        if line.startswith(f"{name}_sum"):
            total = float(line.split()[-1])
        elif line.startswith(f"{name}_count"):
            count = float(line.split()[-1])
    return total, count


def agent(args: list[str], key_file: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--node", "n0", "--ranks", "2",
                             "--cluster-key-file", str(key_file), *args], stdout=open(log, "w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def role(server: ServerProcess) -> str | None:
    try:
        return server.http.get("/health").json().get("role")
    except httpx.TransportError:
        return None


def measure(server: ServerProcess, seconds: float, threads: int) -> dict:
    before = histogram_mean(server.http.get("/metrics").text, "elastic_ep_step_wall_seconds")
    load = StreamingLoad(server.url, threads, 64)
    load.start()
    t0 = time.monotonic()
    time.sleep(seconds)
    load.stop()
    elapsed = time.monotonic() - t0
    after = histogram_mean(server.http.get("/metrics").text, "elastic_ep_step_wall_seconds")
    steps = after[1] - before[1]
    return {"step_ms": round(1000 * (after[0] - before[0]) / max(steps, 1), 3), "steps": int(steps),
            "tokens_per_s": round(sum(1 for _ in load.gaps) / elapsed, 1), "failures": len(load.failures)}


def run_alone(tmp: Path, seconds: float, threads: int) -> dict:
    server = ServerProcess(MODEL, tmp / "alone.log", ready_timeout_s=None)
    ag = agent(["--controller", server.controller_addr()], server.key_file, tmp / "alone-agent.log")
    try:
        server.wait_ready(300)
        return measure(server, seconds, threads)
    finally:
        server.stop()
        terminate(ag, 10)


def run_group(tmp: Path, seconds: float, threads: int, takeover: bool, with_standby: bool = True,
              journal_via: str = "etcd") -> dict:
    etcd = EtcdProcess()
    group = ["--etcd", etcd.url, "--ha-group", "bench", "--ha-lease-s", "5", "--ha-journal-via", journal_via]
    leader = ServerProcess([*MODEL, *group, "--node", "c0"], tmp / "c0.log", ready_timeout_s=None)
    standby = ag = None
    try:
        while role(leader) != "leader":
            time.sleep(0.1)
        if with_standby:
            standby = ServerProcess([*MODEL, *group, "--node", "c1", "--cluster-key-file", str(leader.key_file)],
                                    tmp / "c1.log", ready_timeout_s=None)
        ag = agent(["--etcd", etcd.url, "--ha-group", "bench"], leader.key_file, tmp / "group-agent.log")
        leader.wait_ready(300)
        out = measure(leader, seconds, threads)
        members = {m["name"]: m for m in leader.cluster()["group"]["members"]}
        out["journal_batches"] = members["c0"]["journal_seq"]
        out["standby_lag"] = members["c1"]["lag"] if with_standby else None
        if takeover and standby is not None:
            out["takeover_s"] = takeover_breakdown(leader, standby)
        return out
    finally:
        for s in (leader, standby):
            if s is not None:
                s.stop()
        if ag is not None:
            terminate(ag, 10)
        etcd.stop()


def takeover_breakdown(leader: ServerProcess, standby: ServerProcess) -> dict:
    """SIGKILL of the leader; seconds from the kill to each step of the standby's takeover (the
    agent's and the ranks' registrations and the adopting epoch from the new leader's events, on the
    wall clock of this same machine)."""
    pids = leader.pids()
    leader.proc.kill()
    killed, killed_wall = time.monotonic(), time.time()
    leader.proc.wait()
    while role(standby) != "leader":
        time.sleep(0.01)
    led = time.monotonic()
    while not standby.http.get("/cluster").json().get("listening"):
        time.sleep(0.01)
    controller_up = time.monotonic()
    standby.wait_ready(300)
    ready = time.monotonic()
    events = standby.cluster()["events"]

    def first(pred) -> float | None:
        at = next((e["time_s"] for e in events if pred(e)), None)
        return None if at is None else round(at - killed_wall, 2)

    return {"kill_to_leading": round(led - killed, 2), "kill_to_controller_up": round(controller_up - killed, 2),
            "kill_to_agent_registered": first(lambda e: e["kind"] == "agent"),
            "kill_to_ranks_registered": first(lambda e: e["kind"] == "adopted" and e["rank_id"] is None),
            "kill_to_adopting_epoch": first(lambda e: e["kind"] == "epoch" and e.get("reason") == "adopt"),
            "kill_to_ready": round(ready - killed, 2), "same_pids": standby.pids() == pids}


def run_outage(tmp: Path, threads: int, lease_s: int = 5) -> dict:
    """etcd unreachable (SIGSTOP) for lease_s + 2 s under streaming load: never two leaders, and
    what happens meanwhile (see the module's docstring)."""
    etcd = EtcdProcess()
    group = ["--etcd", etcd.url, "--ha-group", "outage", "--ha-lease-s", str(lease_s)]
    leader = ServerProcess([*MODEL, *group, "--node", "c0"], tmp / "o0.log", ready_timeout_s=None)
    standby = ag = router = None
    try:
        while role(leader) != "leader":
            time.sleep(0.1)
        standby = ServerProcess([*MODEL, *group, "--node", "c1", "--cluster-key-file", str(leader.key_file)],
                                tmp / "o1.log", ready_timeout_s=None)
        ag = agent(["--etcd", etcd.url, "--ha-group", "outage", "--lease-s", "20"], leader.key_file,
                   tmp / "outage-agent.log")
        leader.wait_ready(300)
        while role(standby) != "standby":
            time.sleep(0.1)
        pids = leader.pids()
        router = RouterProcess(["--backend", leader.url, "--backend", standby.url, "--poll-interval-s", "0.2",
                                "--queue-timeout-s", "150"], tmp / "outage-router.log")
        router.wait_ready_backend(leader.url)
        load = StreamingLoad(router.url, threads, 64)
        load.start()
        time.sleep(2)
        most = 0
        deposed = led = None
        etcd.pause()
        paused = time.monotonic()
        resumed = None
        while led is None and time.monotonic() - paused < 120:
            now = time.monotonic()
            if resumed is None and now - paused >= lease_s + 2:
                etcd.resume()
                resumed = now
            roles = [role(leader), role(standby)]
            most = max(most, roles.count("leader"))
            if deposed is None and leader.proc.poll() is not None:
                deposed = now
            if resumed is not None and roles[1] == "leader":
                led = now
            time.sleep(0.02)
        standby.wait_ready(300)
        ready = time.monotonic()
        load.stop()
        return {"most_leaders_at_once": most, "leader_exit_code": leader.proc.poll(),
                "pause_to_deposed_s": None if deposed is None else round(deposed - paused, 2),
                "outage_s": round(resumed - paused, 2),
                "resume_to_leading_s": None if led is None else round(led - resumed, 2),
                "resume_to_ready_s": round(ready - resumed, 2), "same_pids": standby.pids() == pids,
                # new requests while no controller leads are refused by the router (503 + Retry-After; the
                # load retries at once), streams in flight are held and resumed: any other failure is a fault
                "refused_503": sum("503" in f for f in load.failures),
                "other_failures": [f for f in load.failures if "503" not in f][:3]}
    finally:
        for s in (router, leader, standby):
            if s is not None:
                s.stop()
        if ag is not None:
            terminate(ag, 10)
        etcd.stop()


def batch_costs(writer: LeaderJournal, batches: int, per_batch: int) -> tuple[float, float]:
    """(CPU ms, wall ms) of the journal thread per batch of `per_batch` entries, after admissions."""
    for i in range(per_batch):
        writer.add(Admitted(f"cmpl-{i:016x}-0", list(range(200)), SamplingParams(max_tokens=64), i, []))
    writer.flush()
    cpu = wall = 0.0
    for _ in range(batches):
        for i in range(per_batch):
            writer.add(Delivered(f"cmpl-{i:016x}-0", [i], False))
        c0, w0 = time.thread_time(), time.perf_counter()
        writer.flush()
        cpu, wall = cpu + time.thread_time() - c0, wall + time.perf_counter() - w0
    return round(1000 * cpu / batches, 3), round(1000 * wall / batches, 3)


def journal_costs(events: int = 100_000, batches: int = 200, per_batch: int = 64) -> dict:
    """What the journal costs where it runs, in CPU time of the thread that pays it (robust to a
    loaded machine): `add` per event on the HTTP thread, and one batch of `per_batch` entries (a
    step's tokens at 64 running sequences) shipped by the journal thread to a real etcd, and
    directly to one standby (a JournalFollower in a thread of this process, over loopback TCP)."""
    etcd = EtcdProcess()
    try:
        store = GroupStore(etcd.url, "bench")
        term = store.campaign(Seat("c0", "http://c0:1"), store.grant(60)).create_revision
        writer = JournalWriter(store, term, snapshot_every=10**9)
        entry = Delivered("cmpl-0123456789abcdef-0", [1234], False)
        t0 = time.thread_time()
        for _ in range(events):
            writer.add(entry)
        add_us = 1e6 * (time.thread_time() - t0) / events
        writer.flush()
        etcd_cpu, etcd_wall = batch_costs(writer, batches, per_batch)
    finally:
        etcd.stop()
    key = ClusterKey.generate()
    sock, addr = bind_journal_socket("127.0.0.1")
    direct = DirectJournalWriter(sock, key, term)
    follower = JournalFollower(key, "c1", lambda: (addr, term))
    stop = threading.Event()
    following = threading.Thread(target=follower.run, args=(stop, lambda seq: None), daemon=True)
    following.start()
    try:
        while not direct.followers:
            direct.answer()
            time.sleep(0.01)
        direct_cpu, direct_wall = batch_costs(direct, batches, per_batch)
        deadline = time.monotonic() + 10
        while follower.applied < direct.seq and time.monotonic() < deadline:
            time.sleep(0.01)
        applied = follower.applied
    finally:
        stop.set()
        following.join(5)
        sock.close(0)
    return {"add_us_per_event": round(add_us, 3), "entries_per_batch": per_batch,
            "etcd_batch_cpu_ms": etcd_cpu, "etcd_batch_wall_ms": etcd_wall,
            "direct_batch_cpu_ms": direct_cpu, "direct_batch_wall_ms": direct_wall,
            "direct_standby_applied_all": applied == direct.seq}


def step_runs(tmp: Path, seconds: float, threads: int, repeats: int, takeover_last: bool) -> list[dict]:
    """The three deployments in turn, `repeats` times (the takeover after the last etcd run if asked)."""
    rows = []
    for i in range(repeats):
        rows.append({"mode": "alone", **run_alone(tmp, seconds, threads)})
        rows.append({"mode": "etcd", **run_group(tmp, seconds, threads, takeover=takeover_last and i == repeats - 1)})
        rows.append({"mode": "direct", **run_group(tmp, seconds, threads, False, journal_via="direct")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=["takeover", "outage", "step"], default=None)
    parser.add_argument("--journal-via", choices=["etcd", "direct"], default="etcd", help="of --only takeover")
    args = parser.parse_args()
    if args.only in ("takeover", "outage"):
        with tempfile.TemporaryDirectory(prefix="elastic-ep-ha-bench-") as tmp:
            if args.only == "takeover":
                result = run_group(Path(tmp), args.seconds, args.threads, takeover=True,
                                   journal_via=args.journal_via)["takeover_s"]
            else:
                result = run_outage(Path(tmp), args.threads)
        print(json.dumps({args.only: result}, indent=1))
        return
    costs = journal_costs()
    outage = None
    with tempfile.TemporaryDirectory(prefix="elastic-ep-ha-bench-") as tmp:
        if args.only is None:
            outage = run_outage(Path(tmp), args.threads)
        rows = step_runs(Path(tmp), args.seconds, args.threads, args.repeats, takeover_last=args.only is None)
    if args.json:
        print(json.dumps({"journal": costs, "runs": rows, "outage": outage}, indent=1))
        return
    print("journal:", costs)
    print(f"{'mode':6} {'step ms':>8} {'steps':>6} {'tok/s':>7} {'fail':>4} {'batches':>7} {'lag':>4}")
    for r in rows:
        lag = r.get("standby_lag")
        print(f"{r['mode']:6} {r['step_ms']:8.2f} {r['steps']:6d} {r['tokens_per_s']:7.1f} {r['failures']:4d} "
              f"{r.get('journal_batches', ''):>7} {'' if lag is None else lag:>4}")
    for r in rows:
        if "takeover_s" in r:
            print("takeover (s):", r["takeover_s"])
    print("etcd outage:", outage)


if __name__ == "__main__":
    main()
