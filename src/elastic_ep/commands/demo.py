"""`elastic-ep demo`: the elastic demo. Serve the tiny DeepSeek-V3 model on 4 EP ranks, stream
completions, kill -9 one rank mid-stream, and show the pause, the recovery breakdown from
/cluster, and that every request finished with the same text as a fault-free run.

The fault-free reference is computed in this process by the offline engine (every expert
local, no server), so "identical" compares two independent code paths.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from elastic_ep.demo_view import LiveView, StreamState, fmt_bytes, fmt_ms, format_table
from elastic_ep.errors import ElasticEPError
from elastic_ep.harness.server_process import ServerProcess, processes_left
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.tiny import resolve_model
from elastic_ep.model.tokenizer import decode, encode, load_tokenizer

PROMPTS = [
    "A fault-tolerant server",
    "Mixture of experts",
    "for i in range(10):",
    "Rank one goes down and",
    "The weather today is",
    "Experts are routed by",
    "2 4 6 8 10",
    "Once the group recovers",
]
SHOWN_EVENTS = ("fault", "fencing", "epoch", "recovered", "rebalanced", "degraded", "epoch-failed", "request-error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-deepseek-v3", help="checkpoint dir or embedded model name")
    parser.add_argument("--ep-size", type=int, default=4, help="EP ranks (worker processes) (default 4)")
    parser.add_argument("--requests", type=int, default=8, help="concurrent streaming completions (default 8)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    parser.add_argument("--kill-rank", type=int, default=1, help="the rank to kill (default 1)")
    parser.add_argument("--kill-after-tokens", type=int, default=8,
                        help="kill once every stream has this many tokens (default 8)")
    parser.add_argument("--hang", action="store_true", help="SIGSTOP the rank (a hang) instead of SIGKILL")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON summary on stdout (the human-readable view goes to stderr)")
    parser.add_argument("--no-live", action="store_true",
                        help="plain progress lines instead of a view redrawn in place (automatic off a TTY)")
    parser.add_argument("--ready-timeout-s", type=float, default=180.0,
                        help="wait this long for the server to serve with every rank (default 180)")
    parser.add_argument("--recovery-timeout-s", type=float, default=30.0,
                        help="wait this long after the streams for the recovery event (default 30)")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    torch.set_num_threads(1)
    model_dir = resolve_model(args.model)
    num_experts = MoEConfig.from_pretrained(model_dir).num_experts
    out = sys.stderr if args.json else sys.stdout
    prompts = demo_prompts(args.requests)
    sig = signal.SIGSTOP if args.hang else signal.SIGKILL
    what = "SIGSTOP (hang)" if args.hang else "kill -9"
    print(f"elastic-ep demo: {args.model} on {args.ep_size} expert-parallel ranks, {args.requests} streaming "
          f"requests, {what} rank {args.kill_rank} mid-stream.\n"
          f"Watch the cluster fence it and move its experts; every request must finish with the "
          f"fault-free text.\n", file=out, flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="elastic-ep-demo-"))
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(reference_texts, model_dir, prompts, args.max_tokens)
        server = ServerProcess(
            # the default --redundant-experts auto: the group outlives losing a rank
            ["--model", args.model, "--ep-size", str(args.ep_size), "--restart-delay-s", "-1"],
            log_dir / "serve.log", ready_timeout_s=None,
        )
        pids = {server.proc.pid}
        try:
            before = _wait_serving(server, args.ep_size, args.ready_timeout_s)
            pids |= {r["pid"] for r in before["ranks"]}
            _show_ranks(before, num_experts, out)
            try:
                report = _stream_with_fault(server, prompts, args, sig, before, out)
                report["recovery"] = _wait_recovery(server, report, args.recovery_timeout_s)
            except httpx.HTTPError as e:
                raise ElasticEPError(f"lost the server ({e}); its log: {server.log_path}") from None
        finally:
            server.stop()
        report["processes_left"] = processes_left(pids)
        texts = _result(reference, out)
    report["requests"] = [_request_summary(s, texts[s.index]) for s in report.pop("states")]
    report["server_pids"] = sorted(pids)
    report["ok"] = _print_summary(report, out)
    if args.json:
        print(json.dumps(report))
    if report["ok"]:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        print(f"server log kept in {log_dir}", file=out)
    return 0 if report["ok"] else 1


def _check_args(args: argparse.Namespace) -> None:
    if args.ep_size < 2:
        raise ElasticEPError(f"--ep-size {args.ep_size}: the demo needs at least 2 ranks, one to lose")
    if not 0 <= args.kill_rank < args.ep_size:
        raise ElasticEPError(f"--kill-rank {args.kill_rank} is not a rank; ranks are 0..{args.ep_size - 1}")
    if args.requests < 1:
        raise ElasticEPError(f"--requests {args.requests}: at least one request is needed")
    if not 0 < args.kill_after_tokens < args.max_tokens:
        raise ElasticEPError(f"--kill-after-tokens {args.kill_after_tokens} must be between 1 and "
                             f"--max-tokens - 1 ({args.max_tokens - 1}) so the kill lands mid-stream")


def _wait_serving(server: ServerProcess, ep_size: int, timeout_s: float) -> dict:
    try:
        server.wait_ready(timeout_s)
        return server.wait_full_group(ep_size, timeout_s)
    except (TimeoutError, RuntimeError) as e:
        raise ElasticEPError(f"the server did not serve on {ep_size} ranks: {e}\n(its log: {server.log_path}; "
                             f"on a slow machine raise --ready-timeout-s)") from None


def demo_prompts(n: int) -> list[str]:
    return [PROMPTS[i] if i < len(PROMPTS) else f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(n)]


def reference_texts(model_dir: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy completions of the offline engine: one process, every expert local, no fault."""
    engine = OfflineEngine.from_pretrained(model_dir, max_batch=len(prompts))
    tokenizer = load_tokenizer(model_dir)
    results = engine.generate([encode(tokenizer, p) for p in prompts], greedy(max_tokens, ignore_eos=True))
    return [decode(tokenizer, r.token_ids) for r in results]


def stream_completion(http: httpx.Client, model: str, state: StreamState) -> None:
    """POST /v1/completions with stream=true and feed every chunk into `state`; a failure
    (HTTP error, an error event, a dropped connection) is recorded as `state.error`."""
    body = {"model": model, "prompt": state.prompt, "max_tokens": state.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                state.error = f"HTTP {response.status_code}: {response.read().decode()[:200]}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    state.error = chunk["error"].get("message", str(chunk["error"]))
                for choice in chunk.get("choices", []):
                    state.add_chunk(choice["text"], choice["finish_reason"], time.monotonic())
                if chunk.get("usage"):
                    state.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        state.error = f"{type(e).__name__}: {e}"
    if not state.done:
        state.error = "the stream ended without a finish reason"


def _show_ranks(cluster: dict, num_experts: int, out) -> None:
    rows = [[str(r["rank_id"]), str(r["pid"]), r["node"], r["state"],
             f"{cluster['slots_per_rank']} per layer ({r['slots']['used']} in all)"] for r in cluster["ranks"]]
    redundancy = cluster["redundancy"]
    print(f"server ready, epoch {cluster['epoch']}: {num_experts} experts + {redundancy['redundant_experts']} "
          f"redundant copies over {cluster['ep_size']} ranks ({redundancy['chosen']}: every expert still has a "
          f"place after losing any {redundancy['survives']['rank_losses']} rank(s))", file=out)
    print("\n".join(format_table(["rank", "pid", "node", "state", "expert slots"], rows)) + "\n", file=out, flush=True)


def _stream_with_fault(server: ServerProcess, prompts: list[str], args: argparse.Namespace,
                       sig: signal.Signals, before: dict, out, refresh_s: float = 0.1) -> dict[str, Any]:
    """Run the streams, inject the fault once every stream has `kill_after_tokens`, and narrate
    the cluster's events as they come. Returns what the summary needs."""
    states = [StreamState(i, p, args.max_tokens) for i, p in enumerate(prompts)]
    live = not args.no_live and out.isatty()
    view = LiveView(out, states, live)
    view.epoch = before["epoch"]
    model = server.http.get("/v1/models").json()["data"][0]["id"]
    victim = next(r for r in before["ranks"] if r["rank_id"] == args.kill_rank)
    report: dict[str, Any] = {"model": args.model, "ep_size": args.ep_size, "kill_rank": args.kill_rank,
                              "signal": sig.name, "killed_pid": victim["pid"], "epoch_before": before["epoch"],
                              "states": states, "kill_time_s": None}
    seen: set[tuple] = set()
    limits = httpx.Limits(max_connections=len(states) + 1)
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(120.0), limits=limits) as http:
        threads = [threading.Thread(target=stream_completion, args=(http, model, s), daemon=True) for s in states]
        for t in threads:
            t.start()
        view.say(f"streaming {len(states)} requests, {args.max_tokens} tokens each (greedy)")
        while any(t.is_alive() for t in threads):
            if report["kill_time_s"] is None and all(s.tokens >= args.kill_after_tokens or s.done for s in states):
                report["kill_time_s"] = time.time()
                os.kill(victim["pid"], sig)
                view.say(f">>> {'kill -9' if sig == signal.SIGKILL else 'kill -STOP'} rank {args.kill_rank} "
                         f"(pid {victim['pid']}) at {args.kill_after_tokens}+ tokens per stream")
            if report["kill_time_s"] is not None:
                cluster = server.cluster()
                view.epoch = cluster["epoch"]
                for line in event_lines(cluster["events"], report["kill_time_s"], seen):
                    view.say(line)
            view.refresh()
            time.sleep(refresh_s)
        view.close()
    if report["kill_time_s"] is None:
        report["error"] = "every stream ended before the fault was injected"
    return report


def event_lines(events: list[dict], kill_time_s: float, seen: set[tuple]) -> list[str]:
    """A line for each event since the kill that is not in `seen` (which it updates)."""
    lines = []
    for e in events:
        key = (e["time_s"], e["kind"], e["message"])
        if e["time_s"] < kill_time_s or e["kind"] not in SHOWN_EVENTS or key in seen:
            continue
        seen.add(key)
        after = f"+{fmt_ms(e['time_s'] - kill_time_s)}"
        if e["kind"] == "epoch":
            lines.append(f"    {after:>10}  new epoch {e['epoch']} ({e.get('reason', '')}) with ranks {e['members']} "
                         f"(formed in {fmt_ms(e['epoch_change_s'])})")
        else:
            lines.append(f"    {after:>10}  {e['kind']}: {e['message']}")
    return lines


def _wait_recovery(server: ServerProcess, report: dict, timeout_s: float) -> dict | None:
    """The fault and recovered events of the injected fault, with the detection time."""
    if report["kill_time_s"] is None:
        return None
    rank = report["kill_rank"]

    def find(cluster: dict) -> dict | None:
        after = [e for e in cluster["events"] if e["time_s"] >= report["kill_time_s"]]
        fault = next((e for e in after if e["kind"] == "fault" and e["rank_id"] == rank), None)
        done = next((e for e in after if e["kind"] == "recovered" and rank in e["culprits"]), None)
        return {**done, "detect_s": round(fault["time_s"] - report["kill_time_s"], 4),
                "fault_cause": fault["cause"]} if fault and done else None

    try:
        cluster = server.wait_for(find, timeout_s, f"the recovery from losing rank {rank}")
    except TimeoutError:
        return None
    report["epoch_after"] = cluster["epoch"]
    return find(cluster)


def _result(reference: Future, out) -> list[str]:
    if not reference.done():
        print("waiting for the fault-free reference (offline engine) ...", file=out, flush=True)
    return reference.result()


def _request_summary(s: StreamState, reference: str) -> dict[str, Any]:
    return {"index": s.index, "prompt": s.prompt, "tokens": s.tokens, "finish_reason": s.finish_reason,
            "error": s.error, "max_gap_s": round(s.max_gap_s(), 4), "median_gap_s": round(s.median_gap_s(), 4),
            "text": s.text, "reference": reference,
            "finished": s.error is None and s.finish_reason in ("stop", "length"),
            "identical": s.text == reference}


def breakdown_rows(recovery: dict) -> list[list[str]]:
    """The recovery event as table rows: step, time, what it is."""
    moved = ", ".join(f"{src} {fmt_bytes(t['bytes'])}" for src, t in recovery["transfers"].items() if t["bytes"])
    return [
        ["detect", fmt_ms(recovery["detect_s"]), f"kill to the controller's verdict: {recovery['fault_cause']}"],
        ["fence", fmt_ms(recovery["detect_to_fence_s"]), "agent confirms the rank is gone; survivors leave the step"],
        ["placement", fmt_ms(recovery["placement_s"]),
         f"experts without a live copy placed on ranks {recovery['members']}"],
        ["group rebuild", fmt_ms(recovery["rendezvous_s"]), "new process group over the survivors"],
        ["transfers", fmt_ms(recovery["transfer_s"]), f"experts restored by source: {moved or 'none'}"
         + (f" (disk: {recovery['disk_reason']})" if recovery.get("disk_reason") else "")],
        ["verify", fmt_ms(recovery["verify_s"]), f"checksums of the {recovery.get('verified_slots', 0)} slots filled"],
        ["recompute", fmt_ms(recovery["recompute_s"]), "first step of the new epoch (re-prefill of the lost rank's "
         "requests starts)"],
        # A step already past the dead rank's collectives may still deliver tokens after the
        # kill, so the largest gap a client sees can be shorter than this.
        ["total", fmt_ms(recovery["detect_s"] + recovery["total_s"]), "kill to serving again"],
    ]


def _print_summary(report: dict, out) -> bool:
    requests = report["requests"]
    rows = [[f"#{r['index']}", r["prompt"], str(r["tokens"]), r["finish_reason"] or f"error: {r['error']}",
             fmt_ms(r["median_gap_s"]), fmt_ms(r["max_gap_s"]), "identical" if r["identical"] else "DIFFERENT"]
            for r in requests]
    headers = ["req", "prompt", "tokens", "finished", "usual gap", "max gap", "vs reference"]
    print("\nrequests (gaps between tokens; output compared with the offline engine without a fault):", file=out)
    print("\n".join(format_table(headers, rows)), file=out)
    recovery = report["recovery"]
    if recovery is not None:
        print(f"\nrecovery of rank {report['kill_rank']} (epoch {report['epoch_before']} -> {recovery['epoch']}, "
              f"serving on ranks {recovery['members']}):", file=out)
        print("\n".join(format_table(["step", "time", "what"], breakdown_rows(recovery))), file=out)
    problems = [report["error"]] if report.get("error") else []
    if recovery is None and not problems:
        problems.append(f"no recovery from losing rank {report['kill_rank']} was reported in /cluster")
    for r in requests:
        if not r["finished"]:
            problems.append(f"request #{r['index']} did not finish: {r['error'] or r['finish_reason']}")
        elif not r["identical"]:
            problems.append(f"request #{r['index']} differs from the reference:\n      got      {r['text']!r}\n"
                            f"      expected {r['reference']!r}")
    if report["processes_left"]:
        problems.append(f"processes left after stopping the server: {report['processes_left']}")
    finished = sum(r["finished"] for r in requests)
    same = sum(r["identical"] for r in requests)
    gap = max(r["max_gap_s"] for r in requests)
    print(f"\n{finished}/{len(requests)} requests finished, {same}/{len(requests)} identical to the fault-free "
          f"run; largest pause a client saw: {fmt_ms(gap)}; server and workers stopped.", file=out)
    for p in problems:
        print(f"FAILED: {p}", file=out)
    if not problems:
        print("OK: the cluster lost a rank mid-stream and no request noticed more than a pause.", file=out)
    out.flush()
    return not problems
