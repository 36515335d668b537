"""The router against round robin, side by side over the same `serve` instances: a workload of
shared system prompts (P prefixes x R requests, in shuffled order), streamed chat completions,
with more prefixes than one instance's KV pool holds.

    .venv/bin/python benchmarks/router.py [--instances 4] [--prefixes 24] [--requests 32]
        [--concurrency 16 | --rate R] [--prompt-bytes 1500] [--cache-share 1.25] [--max-tokens 4]
        [--patient] [--serve-args "..."] [--json]

The regime the router is for: system prompts outnumber what one instance can keep cached. Each
instance's KV pool (`--num-gpu-blocks-override`) is sized to hold `--cache-share` x its share
(P / instances) of the system prompts, plus the own blocks of `--max-num-seqs` requests; round
robin sends every prefix to every instance, so each instance's LRU cache cycles through all P
of them, while the router gives each instance its share (a new prefix to the instance with the
fewest, router/placement.py).

Each mode gets its own system prompts (same sizes), so neither finds the other's prefixes
cached. Round robin: the client sends request k to instance k mod N. Router: every request to
one `elastic-ep router` over the same instances. Per mode: prefix cache hit rate = the change
of `elastic_ep_prefix_cache_hits_total` / `elastic_ep_prefix_cache_queries_total` summed over
the instances (tokens; the question after the system prompt is never cached, so 100% is out of
reach: the ceiling printed beside it is each prefix's first request missing and the others
finding every full block they share), time to first token at the client (from sending the
request to the first streamed chunk that carries a token id) p50 / p99, and throughput
(requests/s and output tokens/s over the mode's wall time). For the router, also how many
requests each instance got and how many of the mode's prefixes each is home to (what the
instances' GET /prefix_keys say, router/placement.py; requests beyond a home's share are what
load spilled). The goal the router is held to: at least 3x round robin's hit rate and at most
0.5x its TTFT p50.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import shlex
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.router_process import RouterProcess
from elastic_ep.harness.server_process import ServerProcess
from elastic_ep.router.placement import DEFAULT_LIVE_S, homes, parse_report
from elastic_ep.router.scoring import prefix_key, prompt_material

TOPICS = ["rivers", "mountains", "stars", "numbers", "cities", "weather", "code", "music", "ships", "trees"]
BLOCK_SIZE = 16
TOKENS_PER_BYTE = 0.6
"""The tiny models' tokenizer: about 0.6 tokens per byte of this English text (926 tokens for
1,546 bytes), to size the KV pool from the prompt's bytes."""
TAIL_TOKENS = 64
"""The chat template, the question and the output after the system prompt: room for them."""


def system_prompt(mode: str, k: int, size: int) -> str:
    """About `size` bytes, distinct per mode and prefix from the first bytes on."""
    topic = TOPICS[k % len(TOPICS)]
    sentence = f"You are an assistant for questions about {topic}; answer briefly and exactly. "
    return f"[{mode} {k}] " + sentence * max(1, size // len(sentence))


def messages(mode: str, k: int, q: int, size: int) -> list[dict]:
    return [{"role": "system", "content": system_prompt(mode, k, size)},
            {"role": "user", "content": f"Question {q}: tell me one fact."}]


def pool_blocks(args) -> int:
    """KV blocks per instance: `cache_share` x its share of the system prompts, and the own
    blocks (question and output) of max_num_seqs requests."""
    prefix_blocks = math.ceil(args.prompt_bytes * TOKENS_PER_BYTE / BLOCK_SIZE)
    share = args.prefixes / args.instances
    return math.ceil(args.cache_share * share * prefix_blocks) + args.max_num_seqs * math.ceil(TAIL_TOKENS / BLOCK_SIZE)


KV_COUNTERS = ("elastic_ep_prefix_cache_hits", "elastic_ep_prefix_cache_queries", "elastic_ep_num_preemptions")


def kv_counters(servers: list[ServerProcess]) -> np.ndarray | None:
    """Per instance, shape (instances, 3): prefix cache hits and queries (tokens) and
    preemptions; None where no instance exports the prefix cache counters."""
    counts = np.zeros((len(servers), len(KV_COUNTERS)))
    seen = False
    for i, server in enumerate(servers):
        for family in text_string_to_metric_families(server.http.get("/metrics").text):
            if family.name in KV_COUNTERS:
                counts[i, KV_COUNTERS.index(family.name)] = sum(
                    s.value for s in family.samples if s.name.endswith("_total"))
                seen = seen or family.name != "elastic_ep_num_preemptions"
    return counts if seen else None


def first_token_and_count(http: httpx.Client, url: str, body: dict, start: float) -> tuple[float, int]:
    """(seconds from `start` (monotonic) to the first chunk with a token id, completion tokens)
    of one streamed chat."""
    first, tokens = None, 0
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c.get("token_ids") for c in chunk.get("choices", [])):
                first = time.monotonic() - start
    return first if first is not None else float("nan"), tokens


def ceiling(mode: str, server: ServerProcess, args) -> float:
    """The best hit rate any placement gets for the mode's prompts: each prefix's first request
    misses, every other one finds the full blocks it shares with the others of its prefix (the
    question after the system prompt, the chat template's tail and the system prompt's last
    partial block are never cached), in prompt tokens as the instances count them."""
    hits = queries = 0
    for k in range(args.prefixes):
        bodies = [{"model": args.model, "messages": messages(mode, k, q, args.prompt_bytes)} for q in (1, 2)]
        ids = [server.http.post("/tokenize", json=body).json()["tokens"] for body in bodies]
        shared = next((i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), min(map(len, ids)))
        hits += (args.requests - 1) * (min(shared, len(ids[0]) - 1) // BLOCK_SIZE * BLOCK_SIZE)
        queries += args.requests * len(ids[0])
    return hits / queries


def run_mode(mode: str, urls: list[str], servers: list[ServerProcess], args) -> dict:
    jobs = [(k, q) for k in range(args.prefixes) for q in range(args.requests)]
    random.Random(0).shuffle(jobs)
    counter = itertools.count()
    workers = args.concurrency if not args.rate else len(jobs)
    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=workers + 4))
    gaps = np.random.default_rng(0).exponential(1 / args.rate, len(jobs)) if args.rate else np.zeros(len(jobs))
    start = time.monotonic()
    arrivals = start + np.cumsum(gaps)

    def one(i: int) -> tuple[float, int]:
        """Job i, sent at its arrival time (open loop, --rate) or as soon as a client is free."""
        k, q = jobs[i]
        if args.rate:
            time.sleep(max(0.0, arrivals[i] - time.monotonic()))
        body = {"model": args.model, "stream": True, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True},
                "messages": messages(mode, k, q, args.prompt_bytes)}
        sent = arrivals[i] if args.rate else time.monotonic()
        return first_token_and_count(http, urls[next(counter) % len(urls)], body, sent)

    before = kv_counters(servers)
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, range(len(jobs))))
    wall_s = time.monotonic() - start
    after = kv_counters(servers)
    http.close()
    ttft_ms = np.array([t for t, _ in results]) * 1000
    hit_rate, per_instance, preempted = None, None, None
    if before is not None and after is not None and after[:, 1].sum() > before[:, 1].sum():
        hits, queries, preemptions = (after - before).T
        preempted = int(preemptions.sum())
        hit_rate = hits.sum() / queries.sum()
        per_instance = [round(float(h / q), 3) if q else None for h, q in zip(hits, queries, strict=True)]
    return {
        "mode": mode,
        "requests": len(jobs),
        "prefix_hit_rate": hit_rate,
        "hit_rate_ceiling": ceiling(mode, servers[0], args),
        "hit_rate_per_instance": per_instance,
        "preemptions": preempted,
        "ttft_p50_ms": float(np.nanpercentile(ttft_ms, 50)),
        "ttft_p99_ms": float(np.nanpercentile(ttft_ms, 99)),
        "requests_per_s": len(jobs) / wall_s,
        "output_tokens_per_s": sum(n for _, n in results) / wall_s,
        "wall_s": wall_s,
    }


def prefixes_at_home(mode: str, servers: list[ServerProcess], args) -> list[int]:
    """Per instance, how many of the mode's prefixes it is home to, by its GET /prefix_keys."""
    keys = {prefix_key(prompt_material("chat", {"messages": messages(mode, k, 0, args.prompt_bytes)}))
            for k in range(args.prefixes)}
    home_of, _ = homes({s.url: parse_report(s.http.get("/prefix_keys").json()) for s in servers}, float("inf"))
    at_home = Counter(url for key, url in home_of.items() if key in keys)
    return [at_home[s.url] for s in servers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=24)
    parser.add_argument("--requests", type=int, default=32, help="requests per prefix")
    parser.add_argument("--concurrency", type=int, default=16, help="clients, each sending its next request when "
                        "the last one ended (closed loop)")
    parser.add_argument("--rate", type=float, default=0.0, help="requests/s arriving at Poisson times, whatever "
                        "is still running (open loop); TTFT counts from the arrival (0: closed loop)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="each instance's --max-num-seqs")
    parser.add_argument("--prompt-bytes", type=int, default=1500, help="bytes of each system prompt")
    parser.add_argument("--cache-share", type=float, default=1.25,
                        help="KV pool of each instance, in its share (prefixes / instances) of the system prompts")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--patient", action="store_true",
                        help="serve with 10 s detection deadlines (heartbeat, agent, lease 20 s): on a machine "
                             "so loaded that an instance's own agent misses its 1 s heartbeat while starting")
    parser.add_argument("--serve-args", default="", help="more `serve` options, one string")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-router-"))
    blocks = pool_blocks(args)
    serve_args = ["--model", args.model, "--ep-size", "1", "--max-model-len", "2048",
                  "--max-num-seqs", str(args.max_num_seqs), "--block-size", str(BLOCK_SIZE),
                  "--num-gpu-blocks-override", str(blocks)]
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
        run_mode("warm-up", [router.url], servers, warm)
        warmed_s = time.monotonic()
        rows = [run_mode("round-robin", urls, servers, args)]
        # the warm-up's prefix ages out of the router's count (--prefix-live-s) before the router mode, which then
        # starts as a fresh deployment's router would, not with one instance holding a prefix nobody sends
        time.sleep(max(0.0, warmed_s + DEFAULT_LIVE_S + 1 - time.monotonic()))
        sent_before = {u: b["sent"] for u, b in router.backends().items()}
        rows.append(run_mode("router", [router.url], servers, args))
        sent = {u: b["sent"] - sent_before[u] for u, b in router.backends().items()}
        rows[-1]["sent"] = [sent[u] for u in urls]
        rows[-1]["prefixes_at_home"] = prefixes_at_home("router", servers, args)
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
    if args.json:
        print(json.dumps(rows))
        return
    arrival = f"{args.rate:g} requests/s (Poisson)" if args.rate else f"concurrency {args.concurrency}"
    print(f"{args.instances} instances x EP 1, {args.prefixes} prefixes x {args.requests} requests, {arrival}, "
          f"system prompts of {args.prompt_bytes} bytes, KV pool {blocks} blocks of "
          f"{BLOCK_SIZE} per instance, {args.max_tokens} output tokens")
    print("| mode | prefix hit rate (ceiling) | TTFT p50 ms | TTFT p99 ms | requests/s | output tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        hit = "n/a" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.1%}"
        print(f"| {r['mode']} | {hit} ({r['hit_rate_ceiling']:.1%}) | {r['ttft_p50_ms']:.0f} | "
              f"{r['ttft_p99_ms']:.0f} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} |")
    rr, rt = rows
    if rr["prefix_hit_rate"] and rt["prefix_hit_rate"] is not None:
        print(f"router / round robin: hit rate {rt['prefix_hit_rate'] / rr['prefix_hit_rate']:.2f}x, "
              f"TTFT p50 {rt['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f}x, "
              f"throughput {rt['requests_per_s'] / rr['requests_per_s']:.2f}x")
    print(f"router: requests per instance {rt['sent']}, prefixes at home per instance {rt['prefixes_at_home']}")
    for r in rows:
        print(f"{r['mode']}: hit rate per instance {r['hit_rate_per_instance']}, preemptions {r['preemptions']}")


if __name__ == "__main__":
    main()
