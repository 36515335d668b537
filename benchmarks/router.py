"""The router against round robin, side by side over the same `serve` instances: a workload of
shared system prompts (P prefixes x R requests, interleaved), streamed chat completions.

    .venv/bin/python benchmarks/router.py [--instances 2] [--prefixes 8] [--requests 64]
        [--concurrency 8] [--max-tokens 8] [--patient] [--serve-args "..."] [--json]

Each mode gets its own system prompts (same sizes), so neither finds the other's prefixes
cached. Round robin: the client sends request k to instance k mod N. Router: every request to
one `elastic-ep router` over the same instances. Per mode: prefix cache hit rate = the change
of `elastic_ep_prefix_cache_hits_total` / `elastic_ep_prefix_cache_queries_total` summed over
the instances (n/a where the instances do not export them), time to first token (first chunk
with text, at the client) p50 / p99, and throughput (requests/s and output tokens/s over the
mode's wall time). The goal the router is held to: at least 3x round robin's hit rate and at
most 0.5x its TTFT p50, which needs the instances' prefix cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shlex
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.router_process import RouterProcess
from elastic_ep.harness.server_process import ServerProcess

TOPICS = ["rivers", "mountains", "stars", "numbers", "cities", "weather", "code", "music", "ships", "trees"]


def system_prompt(mode: str, k: int) -> str:
    """About 600 bytes, distinct per mode and prefix from the first bytes on."""
    topic = TOPICS[k % len(TOPICS)]
    return f"[{mode} {k}] " + f"You are an assistant for questions about {topic}; answer briefly and exactly. " * 7


def prefix_counters(servers: list[ServerProcess]) -> tuple[float, float] | None:
    """(hits, queries) in tokens summed over the instances, or None where none exports them."""
    hits = queries = 0.0
    seen = False
    for server in servers:
        for family in text_string_to_metric_families(server.http.get("/metrics").text):
            total = sum(s.value for s in family.samples if s.name.endswith("_total"))
            if family.name == "elastic_ep_prefix_cache_hits":
                hits, seen = hits + total, True
            elif family.name == "elastic_ep_prefix_cache_queries":
                queries, seen = queries + total, True
    return (hits, queries) if seen else None


def run_mode(mode: str, urls: list[str], servers: list[ServerProcess], args) -> dict:
    clients = [openai.OpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0, timeout=600) for u in urls]
    model = clients[0].models.list().data[0].id
    jobs = [(k, q) for k in range(args.prefixes) for q in range(args.requests)]
    random.Random(0).shuffle(jobs)
    counter = itertools.count()

    def one(job: tuple[int, int]) -> tuple[float, int]:
        k, q = job
        client = clients[next(counter) % len(clients)]
        start = time.monotonic()
        first, tokens = None, 0
        for chunk in client.chat.completions.create(
            model=model, stream=True, max_tokens=args.max_tokens, temperature=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": system_prompt(mode, k)},
                      {"role": "user", "content": f"Question {q}: tell me one fact."}],
        ):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - start
        return first if first is not None else float("nan"), tokens

    before = prefix_counters(servers)
    start = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, jobs))
    wall_s = time.monotonic() - start
    after = prefix_counters(servers)
    ttft_ms = np.array([t for t, _ in results]) * 1000
    hit_rate = None
    if before is not None and after is not None and after[1] > before[1]:
        hit_rate = (after[0] - before[0]) / (after[1] - before[1])
    return {
        "mode": mode,
        "requests": len(jobs),
        "prefix_hit_rate": hit_rate,
        "ttft_p50_ms": float(np.nanpercentile(ttft_ms, 50)),
        "ttft_p99_ms": float(np.nanpercentile(ttft_ms, 99)),
        "requests_per_s": len(jobs) / wall_s,
        "output_tokens_per_s": sum(n for _, n in results) / wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64, help="requests per prefix")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--patient", action="store_true",
                        help="serve with 10 s detection deadlines (heartbeat, agent, lease 20 s): on a machine "
                             "so loaded that an instance's own agent misses its 1 s heartbeat while starting")
    parser.add_argument("--serve-args", default="", help="more `serve` options, one string (e.g. a KV pool size)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-router-"))
    serve_args = ["--model", args.model, "--ep-size", str(args.ep_size), "--max-model-len", "1024",
                  "--max-num-seqs", str(args.concurrency)]
    serve_args += shlex.split(args.serve_args)
    if args.patient:
        serve_args += ["--heartbeat-timeout-s", "10", "--agent-timeout-s", "10", "--lease-s", "20"]
    servers = [ServerProcess(serve_args, logs / f"serve{i}.log", ready_timeout_s=None)
               for i in range(args.instances)]
    router = None
    try:
        for s in servers:
            s.wait_ready(300)
        urls = [s.url for s in servers]
        router = RouterProcess([a for u in urls for a in ("--backend", u)], logs / "router.log")
        warm = argparse.Namespace(**{**vars(args), "prefixes": 1, "requests": 2 * args.instances})
        run_mode("warm-up", urls, servers, warm)
        rows = [run_mode("round-robin", urls, servers, args), run_mode("router", [router.url], servers, args)]
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{args.instances} instances x EP {args.ep_size}, {args.prefixes} prefixes x {args.requests} requests, "
          f"concurrency {args.concurrency}, {args.max_tokens} output tokens")
    print("| mode | prefix hit rate | TTFT p50 ms | TTFT p99 ms | requests/s | output tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        hit = "n/a" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.1%}"
        print(f"| {r['mode']} | {hit} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['requests_per_s']:.1f} | {r['output_tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
