"""`elastic-ep rollout URL`: a rolling restart of a running `elastic-ep serve` (POST
/rolling_restart), followed to its end with a line per step (GET /rolling_restart). Every worker
process is replaced, one rank at a time, by one started with the options given here and with the
elastic-ep installed on its node now. Exit 0 once every rank was replaced; an error naming the
reason when the server refuses or the rollout fails; exit 1 when it was aborted. `--abort` stops
a rollout in flight (the rank in flight finishes) and follows it to its end. Ctrl-C stops
following, not the rollout. A server with --admin-api-key needs it here too."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import httpx

from elastic_ep.commands.remote import error_message, server_url, unreachable
from elastic_ep.errors import ElasticEPError
from elastic_ep.serve.guard import ADMIN_API_KEY_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", type=server_url, help="the server, e.g. http://127.0.0.1:8000 (or 127.0.0.1:8000)")
    parser.add_argument("--model", default=None,
                        help="start the new processes on this checkpoint directory (the same model as served: "
                             "config, tensor names, dtypes and shapes; e.g. moved to local disks; default unchanged)")
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="bytes of each new rank's KV pool (serve's flag; default unchanged)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="serve's flag, for the new processes (default unchanged)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="serve's flag, for the new processes (default unchanged)")
    parser.add_argument("--abort", action="store_true",
                        help="abort the rollout in flight: the rank in flight finishes, no other is replaced")
    parser.add_argument("--no-wait", action="store_true", help="start (or abort) and return, without following")
    parser.add_argument("--poll-s", type=float, default=0.5, help="how often to read the progress")
    parser.add_argument("--timeout-s", type=float, default=3600.0,
                        help="stop following (exit with an error) after this long; the rollout goes on")
    parser.add_argument("--admin-api-key", default=None,
                        help=f"the server's --admin-api-key (default ${ADMIN_API_KEY_ENV}; none: send no key)")


def run(args: argparse.Namespace) -> int:
    if args.poll_s <= 0 or args.timeout_s <= 0:
        raise ElasticEPError("--poll-s and --timeout-s must be > 0 seconds")
    options = {"model": args.model, "kv_cache_memory": args.kv_cache_memory,
               "gpu_memory_utilization": args.gpu_memory_utilization,
               "num_gpu_blocks_override": args.num_gpu_blocks_override}
    options = {k: v for k, v in options.items() if v is not None}
    if args.abort and options:
        raise ElasticEPError(f"--abort takes no options; {sorted(options)} are for starting a rollout")
    key = args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV)
    with httpx.Client(base_url=args.url, timeout=30.0,
                      headers={"Authorization": f"Bearer {key}"} if key else None) as http:
        path = "/rolling_restart/abort" if args.abort else "/rolling_restart"
        view = _call(http, "post", path, args.url, json=None if args.abort else options)
        print(aborting_line(view) if args.abort else f"rolling restart of {view.get('total', 0)} processes"
              + (f" with {view['options']}" if view.get("options") else ""), flush=True)
        if args.no_wait:
            return 0
        view = follow(http, args.url, args.poll_s, args.timeout_s)
    print(summary(view), flush=True)
    if view["state"] == "failed":
        raise ElasticEPError(f"the rolling restart failed: {view.get('error')}")
    return 0 if view["state"] == "done" or args.abort else 1


def follow(http: httpx.Client, url: str, poll_s: float, timeout_s: float) -> dict[str, Any]:
    """Print a line whenever the rank in flight or its step changes; the view once it ended."""
    deadline = time.monotonic() + timeout_s
    shown = None
    while True:
        view = _call(http, "get", "/rolling_restart", url)
        line = progress_line(view)
        if line != shown:
            print(line, flush=True)
            shown = line
        if not view.get("active"):
            return view
        if time.monotonic() > deadline:
            raise ElasticEPError(f"still rolling after --timeout-s {timeout_s:g}s (it goes on: GET "
                                 f"{url}/rolling_restart, or `elastic-ep rollout {url} --abort`)")
        time.sleep(poll_s)


def progress_line(view: dict[str, Any]) -> str:
    """'[2/4 replaced] rank 1: draining (restart)' and the like."""
    head = f"[{view.get('replaced_count', 0)}/{view.get('total', 0)} replaced]"
    if view.get("rank_in_flight") is not None:
        return f"{head} rank {view['rank_in_flight']}: {view['phase']} ({view['plan']})"
    if view.get("waiting"):
        return f"{head} {view['waiting']}"
    return f"{head} {view.get('state')}"


def aborting_line(view: dict[str, Any]) -> str:
    """What an abort leaves to finish: 'aborting: rank 2 (starting) finishes; ranks replaced: [3, 0]'."""
    rank = view.get("rank_in_flight")
    finishing = f"rank {rank} ({view.get('phase')}) finishes" if rank is not None else "no rank in flight"
    return f"aborting: {finishing}; ranks replaced: {[r['rank_id'] for r in view.get('replaced', [])]}"


def summary(view: dict[str, Any]) -> str:
    lines = [f"rolling restart {view['state']} after {view.get('elapsed_s')}s"]
    for r in view.get("replaced", []):
        by = f" by rank {r['new_rank_id']} (pid {r['new_pid']})" if r.get("new_rank_id") is not None else ""
        lines.append(f"  rank {r['rank_id']} (pid {r['old_pid']}) replaced{by} via {r['plan']} in {r['took_s']}s")
    if view.get("pending"):
        lines.append(f"  not replaced: ranks {view['pending']}")
    return "\n".join(lines)


def _call(http: httpx.Client, method: str, path: str, url: str, json: dict | None = None) -> dict[str, Any]:
    try:
        response = http.request(method, path, json=json)
    except httpx.HTTPError as e:
        raise unreachable(url, e) from None
    if response.status_code != 200:
        raise ElasticEPError(f"{method.upper()} {path} refused (HTTP {response.status_code}): "
                             f"{error_message(response)}")
    return response.json()
