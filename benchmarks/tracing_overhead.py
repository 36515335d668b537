"""What request tracing costs: decode step time on a real server with tracing off and on, side by
side, and the controller's own cost of recording and emitting traces.

    .venv/bin/python benchmarks/tracing_overhead.py [--repeats 2] [--measure-s 20] [--json]

1. Served: tiny-deepseek-v3, EP `--ep-size` (2), `--streams` clients streaming greedy completions of
   `--max-tokens` (64) from a one-word prompt in a loop (decode-bound). Three servers per repeat,
   in turn: tracing off (no flag); on with `--trace-sample-ratio 1` (every request exported: the
   worst case); on with ratio 0.01 (a production setting; faults and the p99 still forced). The
   endpoint is a loopback OTLP/HTTP receiver in this process. After `--warmup-s`, the mean step
   wall time (elastic_ep_step_wall_seconds: plan sent to last result, at the controller) and the
   TPOT p50 (gap between two chunks of a stream) over `--measure-s`. Medians over repeats.
2. In process: RequestTraces fed steps of `--seqs` sequences on 4 ranks (the step loop's call),
   and requests finished and emitted through the OpenTelemetry SDK's batch processor to a
   discarding exporter: microseconds per step and per emitted request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.load import StreamingLoad
from elastic_ep.harness.otlp import OtlpReceiver
from elastic_ep.harness.server_process import ServerProcess

CONFIGS = {"off": [], "on, ratio 1": ["--trace-sample-ratio", "1"], "on, ratio 0.01": ["--trace-sample-ratio", "0.01"]}


def step_wall(server: ServerProcess) -> tuple[float, float]:
    """(sum, count) of elastic_ep_step_wall_seconds."""
    values = {s.name: s.value for f in text_string_to_metric_families(server.http.get("/metrics").text)
              for s in f.samples if s.name.startswith("elastic_ep_step_wall_seconds")}
    return values["elastic_ep_step_wall_seconds_sum"], values["elastic_ep_step_wall_seconds_count"]


def served(args, flags: list[str], receiver: OtlpReceiver) -> dict[str, float]:
    tracing = ["--otlp-traces-endpoint", receiver.url, *flags] if flags else []
    server = ServerProcess(["--model", args.model, "--ep-size", str(args.ep_size), "--max-model-len", "256",
                            "--agent-timeout-s", "5", "--lease-s", "10", *tracing],
                           Path(tempfile.mkdtemp()) / "serve.log")
    spans_before = len(receiver.spans())
    try:
        with StreamingLoad(server.url, args.streams, args.max_tokens, prompts=["hello"]) as load:
            time.sleep(args.warmup_s)
            (s0, n0), t0 = step_wall(server), time.monotonic()
            time.sleep(args.measure_s)
            (s1, n1), t1 = step_wall(server), time.monotonic()
        gaps = np.array([g for t, g in list(load.gaps) if t0 <= t <= t1]) * 1000
        time.sleep(0.5)  # the batch processor's last export
        return {"step_ms": (s1 - s0) / (n1 - n0) * 1000, "steps": n1 - n0,
                "tpot_p50_ms": float(np.percentile(gaps, 50)),
                "spans": len(receiver.spans()) - spans_before, "failures": len(load.failures)}
    finally:
        server.stop()


def in_process(seqs: int, requests: int) -> dict[str, float]:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from elastic_ep.control.otel import OtelSink
    from elastic_ep.control.tracing import RequestTraces
    from elastic_ep.wire import ChunkPlan

    class Discard(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    sink = OtelSink(Discard())
    traces = RequestTraces(sink, 1.0)
    for seq_id in range(seqs):
        traces.arrived(seq_id, f"r{seq_id}", 8)
    chunks = {r: [ChunkPlan(s, [1], 8, True, None, 0, 8) for s in range(r, seqs, 4)] for r in range(4)}
    outputs = [(s, 1) for s in range(seqs)]
    steps = 2000
    t0 = time.perf_counter()
    for _ in range(steps):
        now = time.time_ns()
        traces.step(chunks, now, now, 2, outputs, [])
    step_us = (time.perf_counter() - t0) / steps * 1e6
    t0 = time.perf_counter()
    for seq_id in range(requests):
        traces.arrived(10**6 + seq_id, "r", 8)
        now = time.time_ns()
        traces.step({0: [ChunkPlan(10**6 + seq_id, [1], 8, True, None, 0, 8)]}, now, now, 0,
                    [(10**6 + seq_id, 1)], [])
        traces.finished(10**6 + seq_id, "stop")
    control_us = (time.perf_counter() - t0) / requests * 1e6
    sink.shutdown()  # the sink's thread makes the spans still queued
    total_us = (time.perf_counter() - t0) / requests * 1e6
    return {"step_us": round(step_us, 1), "seqs_per_step": seqs, "request_control_thread_us": round(control_us, 1),
            "request_total_us": round(total_us, 1), "dropped": sink.dropped}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-deepseek-v3")
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--measure-s", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    receiver = OtlpReceiver()
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    try:
        for _ in range(args.repeats):
            for name, flags in CONFIGS.items():
                runs[name].append(served(args, flags, receiver))
    finally:
        receiver.close()
    rows = {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for name, rs in runs.items()}
    micro = in_process(args.seqs, 2000)
    if args.json:
        print(json.dumps({"served": rows, "runs": runs, "in_process": micro}, indent=2))
        return
    print(f"EP {args.ep_size}, {args.streams} streams of {args.max_tokens} tokens, {args.measure_s:.0f} s measured, "
          f"median of {args.repeats}")
    print(f"{'tracing':18s}{'step ms':>10s}{'TPOT p50 ms':>13s}{'steps':>8s}{'spans':>8s}{'failures':>10s}")
    for name, r in rows.items():
        print(f"{name:18s}{r['step_ms']:>10.2f}{r['tpot_p50_ms']:>13.2f}{r['steps']:>8.0f}{r['spans']:>8.0f}"
              f"{r['failures']:>10.0f}")
    print(f"in process: {micro['step_us']} us per step of {micro['seqs_per_step']} sequences; per request emitted "
          f"(6 spans) {micro['request_control_thread_us']} us in the control thread, {micro['request_total_us']} us "
          f"in all")


if __name__ == "__main__":
    main()
