"""`elastic-ep doctor URL`: diagnose a running server. Reads GET /cluster and /metrics twice,
--interval-s apart, and prints findings as symptom -> suspicion -> check -> action, naming
ranks by rank_id, node and pid, then the per-rank table (the slow node radar).

Exit status: 0 with no critical finding, 1 with one (a hang, a stopped process, not ready),
2 when the URL is not reachable or not an elastic-ep server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx

from elastic_ep.commands.remote import server_url, unreachable
from elastic_ep.doctor.diagnose import ProcessInfo, Thresholds, describe, diagnose
from elastic_ep.doctor.findings import Finding, render
from elastic_ep.doctor.metrics import Samples, parse_metrics
from elastic_ep.doctor.stacks import PY_SPY_MISSING, LocalProcesses, py_spy_dump, py_spy_path, worker_process
from elastic_ep.errors import ElasticEPError
from elastic_ep.policy.straggler_verdict import StragglerRule, Verdict, VerdictKind

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
SCRAPES = 5  # /metrics scrapes per diagnosis: the straggler verdict judges the 4 intervals between them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", type=server_url, help="the server, e.g. http://127.0.0.1:8000 (or 127.0.0.1:8000)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per diagnosis")
    parser.add_argument("--watch", type=float, default=None, metavar="S",
                        help="diagnose again every S seconds until Ctrl-C")
    parser.add_argument("--py-spy", action="store_true",
                        help="dump the Python stack of every rank process on this machine with py-spy")
    parser.add_argument("--interval-s", type=float, default=1.0,
                        help="time between the two samples a diagnosis compares (default 1.0)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="HTTP timeout (default 10)")
    parser.add_argument("--straggler-ratio", type=float, default=None,
                        help="own time per step over the peers' median that makes a straggler (default: the "
                             "server's --straggler-ratio, as GET /cluster shows it)")


class Server:
    """GET /cluster and /metrics of one elastic-ep server, with errors that say what is wrong."""

    def __init__(self, url: str, timeout_s: float):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def _get(self, path: str) -> httpx.Response:
        try:
            response = self.http.get(path)
        except httpx.HTTPError as e:
            raise unreachable(self.url, e) from None
        if response.status_code != 200:
            raise ElasticEPError(f"{self.url}{path} answered HTTP {response.status_code}: not an elastic-ep server "
                                 "(GET /cluster and /metrics are elastic-ep's); check the URL and port")
        return response

    def cluster(self) -> dict[str, Any]:
        try:
            cluster = self._get("/cluster").json()
        except ValueError:
            cluster = None
        if not isinstance(cluster, dict) or "ranks" not in cluster or "members" not in cluster:
            raise ElasticEPError(f"{self.url}/cluster is not elastic-ep's cluster view (no ranks / members); "
                                 "check the URL and port")
        return cluster

    def metrics(self) -> Samples:
        return parse_metrics(self._get("/metrics").text)


@dataclass
class Diagnosis:
    """One diagnosis: the later /cluster snapshot, the findings, every member's straggler verdict
    over the doctor's /metrics window, and the state of the rank processes on this machine."""

    cluster: dict[str, Any]
    findings: list[Finding]
    verdicts: dict[int, Verdict]
    processes: dict[int, ProcessInfo]


def _ms(d: dict | None, key: str) -> str:
    return f"{d[key]:.1f}" if d and d.get(key) is not None else "-"


def _process(info: ProcessInfo | None) -> str:
    if info is None:
        return "-"
    return info.status if info.cpu_percent is None else f"{info.status} {info.cpu_percent:.0f}%"


def rank_table(d: Diagnosis) -> str:
    """One line per rank, highest own time first (the slow node radar); `process`: state and
    CPU use over the interval, for ranks on this machine."""
    def own(r) -> float:
        v = d.verdicts.get(r["rank_id"])
        return v.own_ms if v is not None and v.own_ms is not None else -1.0

    lines = [f"{'rank':>4} {'node':<8} {'pid':>7} {'state':<9} {'liveness':<8} {'step p50/p99/max ms':>21} "
             f"{'wait p50/p99':>13} {'own ms':>7} {'verdict':<12} {'req':>4} {'process':<13} progress"]
    for r in sorted(d.cluster["ranks"], key=lambda r: -own(r)):
        v = d.verdicts.get(r["rank_id"])
        step, wait = r.get("step_ms"), r.get("wait_ms")
        lines.append(
            f"{r['rank_id']:>4} {r.get('node', '?'):<8} {r.get('pid') or '-':>7} {r.get('state', '?'):<9} "
            f"{(r.get('liveness') or {}).get('state', '-'):<8} "
            f"{_ms(step, 'p50') + '/' + _ms(step, 'p99') + '/' + _ms(step, 'max'):>21} "
            f"{_ms(wait, 'p50') + '/' + _ms(wait, 'p99'):>13} {f'{own(r):.1f}' if own(r) >= 0 else '-':>7} "
            f"{v.kind.value if v is not None else '-':<12} {r.get('requests', 0):>4} "
            f"{_process(d.processes.get(r['rank_id'])):<13} {describe(r['progress']) if r.get('progress') else '-'}"
        )
    return "\n".join(lines)


def rule_for(cluster: dict[str, Any], args: argparse.Namespace) -> StragglerRule:
    """The server's straggler rule (GET /cluster), judged over the doctor's own window; --straggler-ratio
    overrides the server's ratio."""
    known = {f.name for f in dataclasses.fields(StragglerRule)}
    server = {k: v for k, v in (cluster.get("straggler_rule") or {}).items() if k in known}
    rule = {**server, "window_s": args.interval_s}
    if args.straggler_ratio is not None:
        rule["ratio"] = args.straggler_ratio
    return StragglerRule(**rule)


def _moment(cluster: dict[str, Any]) -> tuple:
    """What a fence or a recovery changes: the epoch, readiness, every rank's pid, state and liveness."""
    return (cluster.get("epoch"), cluster.get("ready"),
            tuple((r["rank_id"], r.get("pid"), r.get("state"), (r.get("liveness") or {}).get("state"))
                  for r in cluster["ranks"]))


def consistent_sample(read_cluster: Callable[[], dict[str, Any]], read_processes: Callable[[], dict[int, ProcessInfo]],
                      attempts: int = 3) -> tuple[dict[str, Any], dict[int, ProcessInfo]]:
    """A /cluster snapshot and the local process states of one moment: the processes read between
    two /cluster reads that agree on `_moment`, so a fence in between cannot pair a cluster that
    says `ready` with a process already gone. Up to `attempts` tries, else the last pair."""
    for _ in range(attempts):
        first = read_cluster()
        processes = read_processes()
        cluster = read_cluster()
        if _moment(first) == _moment(cluster):
            break
    return cluster, processes


def diagnose_once(server: Server, args: argparse.Namespace) -> Diagnosis:
    """Sample /cluster twice, --interval-s apart, and /metrics SCRAPES times in between; diagnose
    the later /cluster sample with the process states of the same moment."""
    before = server.cluster()
    scrapes = [(time.monotonic(), server.metrics())]
    local = LocalProcesses(before, urlparse(server.url).hostname in LOCAL_HOSTS)
    local.start()
    for _ in range(SCRAPES - 1):
        time.sleep(args.interval_s / (SCRAPES - 1))
        scrapes.append((time.monotonic(), server.metrics()))
    after, processes = consistent_sample(server.cluster, local.read)
    th = Thresholds(straggler=rule_for(after, args))
    findings, verdicts = diagnose(before, after, args.interval_s, time.time(), scrapes, processes, th)
    return Diagnosis(after, findings, verdicts, processes)


def nothing_found(d: Diagnosis) -> str:
    """The line printed without findings: it says when there was too little to judge stragglers."""
    unknown = [v for v in d.verdicts.values() if v.kind == VerdictKind.UNKNOWN]
    if unknown:
        return (f"no findings; no straggler verdict for ranks {sorted(v.rank_id for v in unknown)}: "
                f"{unknown[0].evidence} (serve some load, or diagnose a longer --interval-s)")
    return "no findings: every rank steps in time"


def _stacks(cluster: dict[str, Any], findings: list[Finding]) -> dict[int, str]:
    """py-spy dumps of the named ranks first, then the others, for pids on this machine."""
    named = [ref.rank_id for f in findings for ref in f.ranks]
    order = sorted(cluster["ranks"], key=lambda r: (r["rank_id"] not in named, r["rank_id"]))
    stacks = {}
    for r in order:
        if r.get("state") in ("dead", "fenced") or worker_process(r.get("pid"), r["rank_id"]) is None:
            continue
        stacks[r["rank_id"]] = py_spy_dump(r["pid"])
    return stacks


def report(server: Server, args: argparse.Namespace) -> int:
    d = diagnose_once(server, args)
    cluster = d.cluster
    stacks: dict[int, str] | None = None
    if args.py_spy and py_spy_path() is not None:
        stacks = _stacks(cluster, d.findings)
    if args.json:
        print(json.dumps({
            "url": server.url, "epoch": cluster.get("epoch"), "step": cluster.get("step"),
            "ready": cluster.get("ready"), "findings": [f.to_json() for f in d.findings],
            "verdicts": {r: v.to_json() for r, v in d.verdicts.items()},
            "processes": {r: vars(p) for r, p in d.processes.items()},
            "stacks": stacks, "py_spy": None if not args.py_spy or stacks is not None else PY_SPY_MISSING,
        }), flush=True)
    else:
        print(f"elastic-ep doctor: {server.url} epoch {cluster.get('epoch')} step {cluster.get('step')}, "
              f"{len(cluster.get('members', []))} members, ready {cluster.get('ready')}")
        print("\n\n".join(render(f) for f in d.findings) if d.findings else nothing_found(d))
        print("\n" + rank_table(d))
        if args.py_spy and stacks is None:
            print("\n" + PY_SPY_MISSING)
        for rank_id, text in (stacks or {}).items():
            print(f"\n--- py-spy dump of rank {rank_id} ---\n{text}")
        print(flush=True)
    return 1 if any(f.severity == "critical" for f in d.findings) else 0


def _check_args(args: argparse.Namespace) -> None:
    for flag, value in (("--interval-s", args.interval_s), ("--timeout-s", args.timeout_s), ("--watch", args.watch)):
        if value is not None and not value > 0:
            raise ElasticEPError(f"{flag} must be > 0 seconds, got {value}")
    if args.straggler_ratio is not None:
        StragglerRule(ratio=args.straggler_ratio)  # refuses a ratio that cannot work, naming the flag


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    server = Server(args.url, args.timeout_s)
    if args.watch is None:
        return report(server, args)
    while True:
        report(server, args)
        time.sleep(args.watch)
