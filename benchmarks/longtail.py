"""The long tail at the all-to-all on the network test bed (elastic_ep.harness.netns): host A runs
the controller alone, hosts B and C two ranks each; every host's link is delayed (and
rate-limited) as asked, so every B <-> C packet and every control message pays it.

Part `a2a`: --all2all-backend flat vs hierarchical, --enable-dbo off vs on (four servers, each
measured under every link shape): time per output token p50 / p99, the all-to-all wait's share
of the ranks' step time, the ranks' own time per step (step minus wait: what DBO could hide),
sends and bytes of the all-to-alls to the other host per step (counted by the runtime), and the
packets and bytes that left B and C per step (interface counters: everything, control plane
included).

Part `align`: per-step DP alignment (2 ms links, flat): decoding streams of uneven lengths while
long prompts arrive one by one; --dp-align off / on, --dp-migrate off / kv / reprefill: the
decoders' TPOT p50 / p99, the long prompts' TTFT, the busiest rank's tokens per step and the DP
imbalance per step (max / mean tokens), as planned and as run, sequences moved and the time of
a KV move.

    sudo .venv/bin/python benchmarks/longtail.py [--parts a2a,align] [--shapes 2,10,10/2]
        [--concurrency 8] [--max-tokens 48] [--model tiny-deepseek-v3] [--json]

A shape is DELAY_MS or DELAY_MS/RATE_MBIT, on the links of B and C (and A's). Needs root.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.netns import Host, TestBed
from elastic_ep.harness.server_process import ServerProcess

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "1 2 3 4 5",
           "elastic expert parallel", "hello world", "MoE layers route tokens", "a b c d e f"]
A2A_CONFIGS = [("flat", False), ("flat", True), ("hierarchical", False), ("hierarchical", True)]
ALIGN_CONFIGS = [("off", "off"), ("on", "off"), ("on", "kv"), ("on", "reprefill")]


@contextmanager
def serving(bed: TestBed, model: str, flags: list[str], logs: Path, name: str) -> Iterator[ServerProcess]:
    """A 4-rank server with its agents on the bed, stopped afterwards."""
    server = start(bed, model, flags, logs, name)
    try:
        yield server
    finally:
        server.stop()


def emit(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def start(bed: TestBed, model: str, flags: list[str], logs: Path, name: str) -> ServerProcess:
    a, b, c = bed.hosts
    server = ServerProcess(["--model", model, "--ep-size", "4", "--local-ranks", "0", "--redundant-experts", "4",
                            "--restart-delay-s", "-1", "--max-num-seqs", "16", *flags], logs / f"{name}.log", None,
                           host=a.addr, port=8000, popen=a.popen)
    for node, host in (("hostB", b), ("hostC", c)):
        host.popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--controller", server.controller_addr(),
                    "--node", node, "--ranks", "2"], stdout=open(logs / f"{name}-{node}.log", "w"),  # noqa: SIM115
                   stderr=subprocess.STDOUT)
    server.wait_ready(300)
    server.wait_full_group(4, 300)
    return server


def scrape(server: ServerProcess, hosts: list[Host]) -> dict[str, float]:
    """Metric sums (histograms' _sum and _count, counters' _total) and B's and C's interface counters."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in family.samples:
            key = s.name + ("{" + s.labels["plan"] + "}" if "plan" in s.labels else "")
            if "mode" in s.labels:
                key += "{" + s.labels["mode"] + "}"
            out[key] = out.get(key, 0.0) + s.value
    for host in hosts:
        stats = json.loads(host.run(["ip", "-s", "-j", "link", "show", "dev", host.ifname]).stdout)[0]["stats64"]["tx"]
        out["link_packets"] = out.get("link_packets", 0.0) + stats["packets"]
        out["link_bytes"] = out.get("link_bytes", 0.0) + stats["bytes"]
    return out


def stream_load(server: ServerProcess, requests: list[tuple[str, int]], every_s: float = 0.0
                ) -> list[tuple[float, list[float]]]:
    """Stream every request (greedy, ignore_eos), the i-th sent after i * every_s; per request the
    time to its first token and the gaps between its tokens (s)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    start = time.monotonic()

    def one(i: int) -> tuple[float, list[float]]:
        time.sleep(max(start + i * every_s - time.monotonic(), 0.0))
        sent, times = time.monotonic(), []
        for chunk in client.completions.create(model=model, prompt=requests[i][0], max_tokens=requests[i][1],
                                               stream=True, temperature=0, extra_body={"ignore_eos": True}):
            if chunk.choices:
                times.append(time.monotonic())
        return times[0] - sent, [b - a for a, b in itertools.pairwise(times)]

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, range(len(requests))))


def latency(results: list[tuple[float, list[float]]], prefix: str = "") -> dict[str, float]:
    """TPOT p50 / p99 over every gap and TTFT p50 (ms)."""
    gaps = np.array([g for _, gs in results for g in gs]) * 1000
    return {f"{prefix}tpot_p50_ms": float(np.percentile(gaps, 50)),
            f"{prefix}tpot_p99_ms": float(np.percentile(gaps, 99)),
            f"{prefix}ttft_p50_ms": float(np.percentile([t for t, _ in results], 50)) * 1000}


def measured(server: ServerProcess, hosts: list[Host], load: Callable[[], dict[str, float]]) -> dict[str, float]:
    """What `load()` returns, with /metrics and interface deltas over it."""
    before = scrape(server, hosts)
    row = load()
    after = scrape(server, hosts)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d["elastic_ep_step_wall_seconds_count"]
    rank_steps = d["elastic_ep_rank_step_seconds_count"]
    wait_s, step_s = d["elastic_ep_rank_collective_wait_seconds_sum"], d["elastic_ep_rank_step_seconds_sum"]
    row.update({
        "steps": steps, "a2a_wait_share": wait_s / step_s, "own_ms_per_step": (step_s - wait_s) / rank_steps * 1000,
        "wait_ms_per_step": wait_s / rank_steps * 1000,
        "remote_sends_per_step": d.get("elastic_ep_all2all_remote_messages_total", 0.0) / steps,
        "remote_kb_per_step": d.get("elastic_ep_all2all_remote_bytes_total", 0.0) / steps / 1024,
        "link_packets_per_step": d["link_packets"] / steps, "link_kb_per_step": d["link_bytes"] / steps / 1024,
    })
    for plan in ("unaligned", "aligned"):
        count = d.get(f"elastic_ep_dp_imbalance_count{{{plan}}}", 0.0)
        row[f"imbalance_{plan}"] = (d.get(f"elastic_ep_dp_imbalance_sum{{{plan}}}", 0.0) / count
                                    if count else float("nan"))
        row[f"busiest_{plan}"] = (d.get(f"elastic_ep_dp_busiest_tokens_sum{{{plan}}}", 0.0) / count
                                  if count else float("nan"))
    row["moved"] = sum(v for k, v in d.items() if k.startswith("elastic_ep_dp_migrations_total"))
    moves = d.get("elastic_ep_kv_move_seconds_count", 0.0)
    row["kv_move_ms"] = d.get("elastic_ep_kv_move_seconds_sum", 0.0) / moves * 1000 if moves else float("nan")
    return row


def shape_links(bed: TestBed, shape: tuple[float, float | None]) -> None:
    for host in bed.hosts:
        host.set_link(delay_ms=shape[0], rate_mbit=shape[1])


def part_a2a(bed: TestBed, model: str, shapes: list, concurrency: int, max_tokens: int, logs: Path) -> list[dict]:
    requests = [(PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(concurrency)]
    rows = []
    for backend, dbo in A2A_CONFIGS:
        shape_links(bed, (0.0, None))
        flags = (["--all2all-backend", backend, "--no-dp-align", "--dp-migrate", "off"]
                 + (["--enable-dbo"] if dbo else []))
        with serving(bed, model, flags, logs, f"{backend}-dbo{int(dbo)}") as server:
            for shape in shapes:
                shape_links(bed, shape)
                stream_load(server, requests[:2])  # warm-up under this shape
                emit(rows, {"backend": backend, "dbo": dbo, "delay_ms": shape[0], "rate_mbit": shape[1],
                            **measured(server, bed.hosts[1:], lambda: latency(stream_load(server, requests)))})
    shape_links(bed, (0.0, None))
    return rows


def part_align(bed: TestBed, model: str, concurrency: int, max_tokens: int, logs: Path) -> list[dict]:
    """`concurrency` decoding streams (short prompts, outputs from max_tokens to 4 x max_tokens,
    so ranks drift apart as they finish) while as many long prompts (~190 tokens, 8 tokens out)
    arrive one every 0.5 s: what the prefills do to the decoders' TPOT, and the long prompts' TTFT."""
    decoders = [(PROMPTS[i % len(PROMPTS)], max_tokens * (1 + i % 4)) for i in range(concurrency)]
    long_prompt = " ".join(PROMPTS * 5)
    prompts = [(f"{i} {long_prompt}", 8) for i in range(concurrency)]
    rows = []
    shape_links(bed, (2.0, None))
    for align, migrate in ALIGN_CONFIGS:
        flags = ["--dp-align" if align == "on" else "--no-dp-align", "--dp-migrate", migrate,
                 "--dp-align-min-chunk", "16", "--dp-migrate-patience", "4"]
        with serving(bed, model, flags, logs, f"align-{align}-{migrate}") as server:
            stream_load(server, decoders[:2])

            def load() -> dict[str, float]:
                with ThreadPoolExecutor(2) as pool:
                    decoding = pool.submit(stream_load, server, decoders)
                    arriving = pool.submit(stream_load, server, prompts, 0.5)
                    return {**latency(decoding.result(), "decode_"), **latency(arriving.result(), "prefill_")}

            emit(rows, {"dp_align": align, "dp_migrate": migrate, **measured(server, bed.hosts[1:], load)})
    shape_links(bed, (0.0, None))
    return rows


def print_tables(a2a: list[dict], align: list[dict]) -> None:
    if a2a:
        print("\n| link | backend | DBO | TPOT p50 ms | TPOT p99 ms | a2a wait share | own ms/step | wait ms/step "
              "| a2a sends to other host /step | a2a KB /step | link packets /step | link KB /step |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in a2a:
            link = f"{r['delay_ms']:g} ms" + (f", {r['rate_mbit']:g} Mbit/s" if r["rate_mbit"] else "")
            print(f"| {link} | {r['backend']} | {'on' if r['dbo'] else 'off'} | {r['tpot_p50_ms']:.1f} | "
                  f"{r['tpot_p99_ms']:.1f} | {r['a2a_wait_share']:.0%} | {r['own_ms_per_step']:.1f} | "
                  f"{r['wait_ms_per_step']:.1f} | {r['remote_sends_per_step']:.0f} | {r['remote_kb_per_step']:.1f} | "
                  f"{r['link_packets_per_step']:.0f} | {r['link_kb_per_step']:.1f} |")
    if align:
        print("\n| --dp-align | --dp-migrate | decoders' TPOT p50 ms | p99 ms | long prompts' TTFT p50 ms | "
              "busiest rank's tokens/step planned | run | max/mean planned | run | own ms/step | moved | KV move ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in align:
            print(f"| {r['dp_align']} | {r['dp_migrate']} | {r['decode_tpot_p50_ms']:.1f} | "
                  f"{r['decode_tpot_p99_ms']:.1f} "
                  f"| {r['prefill_ttft_p50_ms']:.0f} | {r['busiest_unaligned']:.1f} | {r['busiest_aligned']:.1f} | "
                  f"{r['imbalance_unaligned']:.2f} | {r['imbalance_aligned']:.2f} | {r['own_ms_per_step']:.1f} | "
                  f"{r['moved']:.0f} | {r['kv_move_ms']:.1f} |")


def parse_shape(text: str) -> tuple[float, float | None]:
    delay, _, rate = text.partition("/")
    return float(delay), float(rate) if rate else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="a2a,align")
    parser.add_argument("--shapes", default="2,10,10/2", help="link shapes: DELAY_MS[/RATE_MBIT], comma separated")
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    parts = args.parts.split(",")
    logs = Path(tempfile.mkdtemp(prefix="longtail-"))
    with TestBed(3) as bed:
        a2a = part_a2a(bed, args.model, [parse_shape(s) for s in args.shapes.split(",")], args.concurrency,
                       args.max_tokens, logs) if "a2a" in parts else []
        align = part_align(bed, args.model, args.concurrency, args.max_tokens, logs) if "align" in parts else []
    if args.json:
        print(json.dumps({"a2a": a2a, "align": align}, indent=2))
    print_tables(a2a, align)
    print(f"\nserver logs: {logs}")


if __name__ == "__main__":
    main()
