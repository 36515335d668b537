"""Serving throughput and latency at EP 1, 2 and 4 under concurrent streaming load, and
where a step's time goes: the controller round trip and the all-to-alls.

    .venv/bin/python benchmarks/serve.py [--concurrency 8] [--max-tokens 64] [--model tiny-deepseek-v3]

Per EP size: one `elastic-ep serve` process, a warm-up, then `concurrency` streaming
completions with ignore_eos. Output tokens/s = completion tokens / wall time; time per output
token = gaps between a stream's chunks (p50, p99 over all streams). Shares come from /metrics
deltas over the run: controller round trip = sum(step wall at the controller - slowest rank's
step) / sum(step wall); all-to-all = sum(collective wait) / sum(rank step time). Last, EP 4 decode
with the padded dispatch against split sizes exchanged every layer, interleaved.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.server_process import ServerProcess

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "1 2 3 4 5",
           "elastic expert parallel", "hello world", "MoE layers route tokens", "a b c d e f"]


def metric_sums(server: ServerProcess) -> dict[str, float]:
    """family name -> sum of its `_sum` samples over all label sets."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                sums[family.name] = sums.get(family.name, 0.0) + sample.value
    return sums


def stream_load(server: ServerProcess, concurrency: int, max_tokens: int) -> dict[str, float]:
    """Run `concurrency` streaming completions at once; tokens/s and chunk-gap percentiles."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    def one(prompt: str) -> tuple[int, list[float]]:
        times, tokens = [], 0
        for chunk in client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        ):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices:
                times.append(time.monotonic())
        return tokens, [b - a for a, b in itertools.pairwise(times)]

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall_s = time.monotonic() - start
    gaps = np.array([g for _, gs in results for g in gs]) * 1000
    return {
        "output_tokens_per_s": sum(t for t, _ in results) / wall_s,
        "tpot_p50_ms": float(np.percentile(gaps, 50)),
        "tpot_p99_ms": float(np.percentile(gaps, 99)),
        "wall_s": wall_s,
    }


def measure(model: str, ep_size: int, concurrency: int, max_tokens: int, log_dir: Path) -> dict[str, float]:
    server = ServerProcess(["--model", model, "--ep-size", str(ep_size), "--redundant-experts", "0",
                            "--max-num-seqs", str(concurrency)],
                           log_dir / f"serve-ep{ep_size}.log")
    try:
        stream_load(server, concurrency, 8)
        before = metric_sums(server)
        result = stream_load(server, concurrency, max_tokens)
        after = metric_sums(server)
    finally:
        server.stop()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    result["controller_share"] = (delta["elastic_ep_controller_round_trip_seconds"]
                                  / delta["elastic_ep_step_wall_seconds"])
    result["all_to_all_share"] = (delta["elastic_ep_rank_collective_wait_seconds"]
                                  / delta["elastic_ep_rank_step_seconds"])
    return {"ep_size": ep_size, **result}


def padded_vs_counted(model: str, concurrency: int, max_tokens: int, repeats: int, log_dir: Path) -> dict:
    """Median TPOT p50 at EP 4 with the padded decode dispatch and with split sizes exchanged
    every layer: two servers alive at once, runs interleaved so both see the same noise."""
    servers = {
        pad: ServerProcess(["--model", model, "--ep-size", "4", "--redundant-experts", "0",
                            "--max-num-seqs", str(concurrency),
                            "--padded-dispatch-max-tokens", str(pad)], log_dir / f"serve-pad{pad}.log")
        for pad in (16, 0)
    }
    tpot: dict[int, list[float]] = {16: [], 0: []}
    try:
        for server in servers.values():
            stream_load(server, concurrency, 8)
        for _ in range(repeats):
            for pad, server in servers.items():
                tpot[pad].append(stream_load(server, concurrency, max_tokens)["tpot_p50_ms"])
    finally:
        for server in servers.values():
            server.stop()
    return {"padded_tpot_p50_ms": float(np.median(tpot[16])), "counted_tpot_p50_ms": float(np.median(tpot[0]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ep-sizes", default="1,2,4")
    parser.add_argument("--padding-repeats", type=int, default=4,
                        help="interleaved runs of the padded vs split-size dispatch comparison (0: skip)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        for ep_size in (int(x) for x in args.ep_sizes.split(",")):
            rows.append(measure(args.model, ep_size, args.concurrency, args.max_tokens, Path(log_dir)))
            print(json.dumps(rows[-1]), flush=True)
        if args.padding_repeats:
            print(json.dumps(padded_vs_counted(args.model, args.concurrency, args.max_tokens, args.padding_repeats,
                                               Path(log_dir))), flush=True)
    print("\n| EP | output tok/s | TPOT p50 ms | TPOT p99 ms | controller round trip | all-to-all |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ep_size']} | {r['output_tokens_per_s']:.0f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} "
              f"| {r['controller_share']:.0%} | {r['all_to_all_share']:.0%} |")


if __name__ == "__main__":
    main()
