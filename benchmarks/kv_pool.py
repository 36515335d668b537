"""The KV pool side by side: paged against padded cache, prefix caching's time to first token, a
burst of long prompts beyond the pool.

    .venv/bin/python benchmarks/kv_pool.py [--baseline-ref main] [--repeats 3]

All on one random DeepSeek-V3-shaped checkpoint with 2 layers and 32 heads (make-tiny), float32,
one thread per process.
(a) Offline generation of a mix of short and long prompts (`--short` prompts of ~60 tokens and
    `--long` of ~1,700), greedy, `--max-tokens` each, all in one batch: this tree's paged cache
    against the padded cache of `--baseline-ref` (its src/ extracted with `git archive` into a
    temporary directory: the padded cache is not kept in this tree). Each run is a fresh process;
    peak memory is its peak RSS, throughput (prompt + generated tokens) / wall time; the
    generated tokens of the two must be equal.
(b) `serve --ep-size 1`: time to first token of a streamed request whose first ~800 tokens are
    those of an earlier request, against a request of the same length whose prefix is new (cold);
    median over `--repeats` pairs, prefix hits from /metrics.
(c) `serve --ep-size 2 --num-gpu-blocks-override N`: `--burst` concurrent long prompts whose
    blocks at their longest exceed the pools together several times over; every request must
    finish, the server must stay healthy, preemptions are read from /metrics.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.server_process import ServerProcess
from elastic_ep.model.tiny import make_tiny
from elastic_ep.model.tokenizer import encode, load_tokenizer

REPO = Path(__file__).resolve().parent.parent
# (c): prompts of ~600 tokens (38 blocks of 16) that grow by 4 blocks each; 120 blocks per rank admit
# three and leave 6 free, fewer than their 12 of growth: decodes must preempt
BURST_MAX_TOKENS = 64
# Runs in a fresh interpreter with the given src/ first on the path: this tree's or the baseline's.
CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from elastic_ep.model.engine import OfflineEngine, greedy
torch.set_num_threads(1)
spec = json.load(sys.stdin)
engine = OfflineEngine.from_pretrained(spec["model"], max_batch=len(spec["prompts"]))
t0 = time.perf_counter()
results = engine.generate(spec["prompts"], greedy(spec["max_tokens"], ignore_eos=True))
wall_s = time.perf_counter() - t0
print(json.dumps({"wall_s": wall_s, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "tokens": [r.token_ids for r in results]}))
"""


def words(n: int, salt: int) -> str:
    """A text of n distinct-ish words (salt makes another text)."""
    return " ".join(f"w{(i * 7919 + salt * 104729) % 100003}" for i in range(n))


def text_of_tokens(tokenizer, tokens: int, salt: int) -> str:
    """A text that encodes to about `tokens` tokens."""
    n = tokens
    while len(encode(tokenizer, words(n, salt))) > tokens:
        n -= 1 + n // 100
    return words(n, salt)


def offline_run(src: Path, model: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(src)], input=json.dumps(
        {"model": str(model), "prompts": prompts, "max_tokens": max_tokens}), capture_output=True, text=True,
        check=True, timeout=3600)
    return json.loads(out.stdout.splitlines()[-1])


def paged_vs_padded(model: Path, baseline_ref: str, short: int, long: int, max_tokens: int, tmp: Path) -> dict:
    tokenizer = load_tokenizer(model)
    prompts = [encode(tokenizer, text_of_tokens(tokenizer, 60, i)) for i in range(short)]
    prompts += [encode(tokenizer, text_of_tokens(tokenizer, 1700, 100 + i)) for i in range(long)]
    baseline = tmp / "baseline"
    baseline.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", baseline_ref, "src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive, check=True)
    runs = {"padded": offline_run(baseline / "src", model, prompts, max_tokens),
            "paged": offline_run(REPO / "src", model, prompts, max_tokens)}
    tokens = sum(len(p) + max_tokens for p in prompts)
    return {
        "prompt_tokens": [len(p) for p in prompts],
        **{f"{name}_peak_gb": round(r["peak_rss_bytes"] / 1e9, 3) for name, r in runs.items()},
        **{f"{name}_tokens_per_s": round(tokens / r["wall_s"], 1) for name, r in runs.items()},
        "same_tokens": runs["padded"]["tokens"] == runs["paged"]["tokens"],
    }


def metric(server: ServerProcess, name: str) -> float:
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in family.samples:
            if s.name == name and not s.labels:
                return s.value
    return 0.0


def ttft_s(client: openai.OpenAI, model: str, prompt: str) -> float:
    t0 = time.perf_counter()
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=2, stream=True, temperature=0):
        if chunk.choices and chunk.choices[0].text:
            return time.perf_counter() - t0
    return time.perf_counter() - t0


def prefix_ttft(model: Path, repeats: int, tmp: Path) -> dict:
    tokenizer = load_tokenizer(model)
    server = ServerProcess(["--model", str(model), "--ep-size", "1", "--redundant-experts", "0", "--max-model-len",
                            "2048"], tmp / "serve-prefix.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        ttft_s(client, name, text_of_tokens(tokenizer, 100, 999))  # warm-up
        warm, cold = [], []
        hits = metric(server, "elastic_ep_prefix_cache_hits_total")
        for i in range(repeats):
            prefix = text_of_tokens(tokenizer, 800, 200 + i)
            ttft_s(client, name, prefix + " first question")
            warm.append(ttft_s(client, name, prefix + " second question"))
            cold.append(ttft_s(client, name, text_of_tokens(tokenizer, 800, 300 + i) + " second question"))
        hits = metric(server, "elastic_ep_prefix_cache_hits_total") - hits
    finally:
        server.stop()
    return {"prefix_tokens": len(encode(tokenizer, text_of_tokens(tokenizer, 800, 200))),
            "warm_ttft_s": round(float(np.median(warm)), 4), "cold_ttft_s": round(float(np.median(cold)), 4),
            "warm_over_cold": round(float(np.median(warm) / np.median(cold)), 3), "prefix_hit_tokens": hits}


def burst(model: Path, requests: int, blocks: int, tmp: Path) -> dict:
    tokenizer = load_tokenizer(model)
    server = ServerProcess(["--model", str(model), "--ep-size", "2", "--redundant-experts", "0", "--max-model-len",
                            "2048", "--num-gpu-blocks-override", str(blocks)], tmp / "serve-burst.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=1800)
        name = client.models.list().data[0].id
        prompts = [text_of_tokens(tokenizer, 600, 400 + i) for i in range(requests)]

        def one(prompt: str) -> str:
            try:
                out = client.completions.create(model=name, prompt=prompt, max_tokens=BURST_MAX_TOKENS,
                                                temperature=0, extra_body={"ignore_eos": True})
                return "ok" if out.usage.completion_tokens == BURST_MAX_TOKENS else "short"
            except openai.APIError as e:
                return f"failed: {e}"

        t0 = time.perf_counter()
        with ThreadPoolExecutor(requests) as pool:
            outcomes = list(pool.map(one, prompts))
        wall_s = time.perf_counter() - t0
        return {"requests": requests, "pool_blocks_per_rank": blocks,
                "blocks_wanted": requests * -(-(600 + BURST_MAX_TOKENS) // 16), "finished": outcomes.count("ok"),
                "failed": [o for o in outcomes if o != "ok"], "preemptions": metric(server,
                                                                                    "elastic_ep_num_preemptions_total"),
                "healthy_after": server.http.get("/health").status_code == 200, "wall_s": round(wall_s, 2)}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-ref", default="main", help="git ref whose padded cache (a) compares against")
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--burst", type=int, default=12)
    parser.add_argument("--burst-blocks", type=int, default=120, help="(c): blocks of 16 tokens per rank")
    parser.add_argument("--parts", default="a,b,c")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = make_tiny("deepseek_v3", tmp / "model", layers=2, heads=32)
        if "a" in parts:
            print(json.dumps({"a_paged_vs_padded": paged_vs_padded(model, args.baseline_ref, args.short, args.long,
                                                                   args.max_tokens, tmp)}), flush=True)
        if "b" in parts:
            print(json.dumps({"b_prefix_ttft": prefix_ttft(model, args.repeats, tmp)}), flush=True)
        if "c" in parts:
            print(json.dumps({"c_burst": burst(model, args.burst, args.burst_blocks, tmp)}), flush=True)


if __name__ == "__main__":
    main()
