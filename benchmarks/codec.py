"""The wire codec against pickle: encode + decode of a `StepPlan` and a `StepResult` at
realistic sizes, and what the cluster key's HMAC adds.

    .venv/bin/python benchmarks/codec.py [--seqs 64] [--layers 58] [--experts 256] [--json]
    .venv/bin/python benchmarks/codec.py --serve-against OTHER/src [--ep-size 4] [--repeats 4]

StepPlan: `--seqs` sequences, one in four a 128-token prefill chunk, the rest one decode token,
each with its sampling parameters. StepResult: a token per sequence, the expert load
[layers, experts] (int64; DeepSeek-V3's 58 MoE layers x 256 experts by default), logprobs
(top 5) for a quarter of the sequences. Rows: `pickle` (what the sockets did before: dumps +
loads), `msgspec` (encode + typed decode), `msgspec + HMAC` (the full path of a frame:
`ClusterKey.seal` + `Inbox.read`). Microseconds per message, median of 7 repeats; bytes per
frame.

`--serve-against SRC`: the step time side by side. Two `elastic-ep serve --ep-size N` of the
tiny model run at once, one from this tree and one from the source tree SRC (a checkout whose
sockets pickle); `--repeats` interleaved runs of 8 concurrent streams of 64 tokens each, so both
see the same noise. Per server: the median over runs of the mean step wall time at the
controller (`elastic_ep_step_wall_seconds`), of the controller round trip
(`elastic_ep_controller_round_trip_seconds`) and of the TPOT p50.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np

from elastic_ep.model.sampling import SamplingParams, TokenLogprobs
from elastic_ep.wire import (
    CONTROLLER_TO_WORKER,
    STEP_TO_CONTROLLER,
    ChunkPlan,
    ClusterKey,
    Inbox,
    StepPlan,
    StepResult,
    decoder,
    encode,
)


def step_plan(seqs: int) -> StepPlan:
    chunks = [ChunkPlan(i, list(range(1000 + i, 1000 + i + (128 if i % 4 == 0 else 1))), 300 + i, True,
                        SamplingParams(max_tokens=256, temperature=0.7, top_p=0.95, top_k=50, seed=i), 7 * i, 120)
              for i in range(seqs)]
    return StepPlan(12, 3456, chunks, [900, 901], dispatch_rows=16)


def step_result(seqs: int, layers: int, experts: int) -> StepResult:
    rng = np.random.default_rng(0)
    load = rng.integers(0, 64, size=(layers, experts), dtype=np.int64)
    logprobs = {i: TokenLogprobs(-0.25, tuple((j, -0.25 * (j + 1)) for j in range(5))) for i in range(0, seqs, 4)}
    return StepResult(12, 3456, 3, {i: 4000 + i for i in range(seqs)}, 0.021, 0.012, 0.004, 0.003, load,
                      seqs * 8, logprobs)


def per_message_us(fn, number: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def measure(message, accepts, number: int) -> dict[str, dict[str, float]]:
    key = ClusterKey.generate()
    inbox = Inbox("bench", accepts, key)
    typed = decoder(accepts)
    pickled = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    body = encode(message)
    sealed = key.seal(message)
    assert inbox.read(sealed) is not None
    return {
        "pickle": {"us": per_message_us(lambda: pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)),
                                        number), "bytes": len(pickled)},
        "msgspec": {"us": per_message_us(lambda: typed.decode(encode(message)), number), "bytes": len(body)},
        "msgspec + HMAC": {"us": per_message_us(lambda: inbox.read(key.seal(message)), number),
                           "bytes": len(sealed[0]) + len(sealed[1])},
    }


# Detection slower than the defaults, on both servers: a false fault from a shared machine's
# contention would end a run, and detection is not what is measured.
PATIENT = ("--heartbeat-timeout-s", "3", "--agent-timeout-s", "3", "--lease-s", "15", "--startup-timeout-s", "600")


def start_serve(src: str, ep_size: int, log: Path) -> tuple[subprocess.Popen, str]:
    """`elastic-ep serve` of the source tree `src`, ready; (process, url)."""
    from elastic_ep.harness.server_process import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "elastic_ep.cli", "serve", "--model", "tiny-deepseek-v3",
                             "--ep-size", str(ep_size), "--redundant-experts", "0", "--max-num-seqs", "8",
                             "--port", str(port), *PATIENT], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"serve of {src} exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"serve of {src} not ready")
    except BaseException:
        proc.terminate()
        proc.wait(30)
        raise


def step_means(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")) and family.name in (
                    "elastic_ep_step_wall_seconds", "elastic_ep_controller_round_trip_seconds"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def serve_side_by_side(other_src: str, ep_size: int, repeats: int) -> dict[str, dict[str, float]]:
    from serve import stream_load  # benchmarks/serve.py, beside this script

    here = str(Path(__file__).resolve().parents[1] / "src")
    logs = Path(tempfile.mkdtemp(prefix="codec-bench-"))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        for name, src in (("msgspec + HMAC", here), ("pickle", other_src)):
            servers[name] = start_serve(src, ep_size, logs / f"{name}.log")
            runs[name] = []
        for _, url in servers.values():
            stream_load(SimpleNamespace(url=url), 8, 8)
        for _ in range(repeats):
            for name, (_, url) in servers.items():
                before = step_means(url)
                tpot = stream_load(SimpleNamespace(url=url), 8, 64)["tpot_p50_ms"]
                after = step_means(url)
                d = {k: after[k] - before.get(k, 0.0) for k in after}
                runs[name].append({
                    "step_wall_ms": (1000 * d["elastic_ep_step_wall_seconds_sum"]
                                     / d["elastic_ep_step_wall_seconds_count"]),
                    "round_trip_ms": 1000 * d["elastic_ep_controller_round_trip_seconds_sum"]
                    / d["elastic_ep_controller_round_trip_seconds_count"],
                    "tpot_p50_ms": tpot})
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    return {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for name, rs in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve-against", metavar="SRC",
                        help="source tree of the pickle codec: step time side by side")
    parser.add_argument("--ep-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    if args.serve_against:
        figures = serve_side_by_side(args.serve_against, args.ep_size, args.repeats)
        print(json.dumps(figures, indent=1) if args.json else
              "\n".join(f"{name:<15} " + ", ".join(f"{k} {v}" for k, v in row.items())
                        for name, row in figures.items()))
        return
    results = {
        "StepPlan": measure(step_plan(args.seqs), CONTROLLER_TO_WORKER, args.number),
        "StepResult": measure(step_result(args.seqs, args.layers, args.experts), STEP_TO_CONTROLLER, args.number),
    }
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{args.seqs} sequences, expert load [{args.layers}, {args.experts}]")
    print(f"{'message':<11} {'codec':<15} {'encode+decode us':>17} {'bytes':>8}")
    for name, rows in results.items():
        for codec, row in rows.items():
            print(f"{name:<11} {codec:<15} {row['us']:>17.1f} {row['bytes']:>8}")


if __name__ == "__main__":
    main()
