"""The long tail at the all-to-all, end to end: per-step DP alignment (prefill cut to the step's
level, decoding sequences moved by KV copy or re-prefill), two micro-batches per step
(--enable-dbo) and the two-stage all-to-all (--all2all-backend hierarchical) over two nodes (a
`serve` with two local ranks plus an `elastic-ep agent --node node1` with two more, one machine).

Every combination of backend and DBO serves greedy and seeded output equal to single-process
`elastic-ep generate`, while sequences move between ranks; with DBO and the hierarchical
backend on, a rank SIGKILLed mid-stream (on either node, the leader of its node included) is
recovered with every output equal to the fault-free run, and a scale down and up under load loses
no request; the host groups follow every new membership. With DBO the readiness gate warms every
shape in the micro-batches a step runs it in, and no step runs a shape its epoch did not warm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import cache

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.load import streams_with_fault
from elastic_ep.model.tiny import resolve_model
from elastic_ep.model.tokenizer import decode, load_tokenizer

from .conftest import PROMPTS, Server, concurrently, reference, reference_load

# 16 requests with different lengths of output: ranks run uneven numbers of decoding sequences
REQUESTS = [(f"request {i}: {PROMPTS[i % len(PROMPTS)]}", 4 + 3 * (i % 8)) for i in range(16)]
LONGEST = max(n for _, n in REQUESTS)
ALIGN = ["--dp-align-min-chunk", "4", "--dp-migrate-patience", "1", "--max-num-batched-tokens", "16"]


@cache
def expected_texts(model: str) -> tuple[str, ...]:
    """Greedy `elastic-ep generate` of every request: its first max_tokens tokens as text."""
    cmd = [sys.executable, "-m", "elastic_ep.cli", "generate", "--json", "--model", model, "--max-tokens",
           str(LONGEST), "--temperature", "0"]
    for prompt, _ in REQUESTS:
        cmd += ["--prompt", prompt]
    lines = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout.splitlines()
    tokenizer = load_tokenizer(resolve_model(model))
    return tuple(decode(tokenizer, json.loads(line)["token_ids"][:n]) for line, (_, n) in zip(lines, REQUESTS,
                                                                                               strict=True))


def start_two_nodes(tmp_path, model: str, *flags: str) -> tuple[Server, subprocess.Popen]:
    """4 ranks: 2 on node0 (the serve process), 2 on node1 (an agent)."""
    server = Server(["--model", model, "--ep-size", "4", "--local-ranks", "2", "--node", "node0",
                     "--restart-delay-s", "1.0", *flags], tmp_path / "serve.log", ready_timeout_s=None)
    agent = subprocess.Popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--controller",
                              server.controller_addr(), "--node", "node1", "--ranks", "2",
                              "--cluster-key-file", str(server.key_file)],
                             stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        server.wait_ready(180)
        server.wait_full_group(4, 120)
    except BaseException:
        stop(server, agent)
        raise
    return server, agent


def stop(server: Server, agent: subprocess.Popen) -> None:
    server.stop()
    agent.send_signal(signal.SIGTERM)
    agent.wait(30)


def metric(server: Server, name: str, **labels: str) -> float:
    """Sum of the samples of `name` with these labels in /metrics."""
    return sum(s.value for f in text_string_to_metric_families(server.http.get("/metrics").text)
               for s in f.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def serve_requests(server: Server) -> list[str]:
    return concurrently(lambda r: server.complete(r[0], r[1], temperature=0), REQUESTS)


def check_exact(server: Server, model: str) -> None:
    """Greedy output of the uneven requests and seeded output of PROMPTS equal `generate`."""
    assert serve_requests(server) == list(expected_texts(model))
    seeded = concurrently(lambda p: server.complete(p, 12, temperature=0.8, seed=5), PROMPTS[:4])
    assert seeded == list(reference(model, tuple(PROMPTS[:4]), 12, 0.8, 5))
    assert metric(server, "elastic_ep_dp_imbalance_count", plan="aligned") > 0


def test_flat_with_dbo_and_kv_moves_is_exact(tmp_path):
    server, agent = start_two_nodes(tmp_path, "tiny-deepseek-v3", "--enable-dbo", "--dp-migrate", "kv", *ALIGN)
    try:
        check_exact(server, "tiny-deepseek-v3")
        assert metric(server, "elastic_ep_dp_migrations_total", mode="kv") > 0
        assert metric(server, "elastic_ep_all2all_remote_messages_total") > 0
        cluster = server.cluster()
        assert cluster["data_plane"]["nodes"] == {"node0": [0, 1], "node1": [2, 3]}
        # the readiness gate warmed what DBO runs: every shape in two micro-batches (and 1 token in
        # one, a step where every rank is idle or decodes one), and no step ran anything else
        warmup = cluster["cold_start"]["warmup"]
        assert warmup["unwarmed_steps"] == 0 and warmup["steps_by_micro_batches"].get("2", 0) > 0, (
            warmup["unwarmed_steps"], warmup["steps_by_micro_batches"])
        assert list(zip(warmup["shapes"], warmup["micro_batches"], strict=True)) == [
            (1, 1), (1, 2), (2, 2), (4, 2), (8, 2), (16, 2)], warmup
    finally:
        stop(server, agent)


def test_hierarchical_without_dbo_re_prefilling_moved_sequences_is_exact(tmp_path):
    server, agent = start_two_nodes(tmp_path, "tiny-qwen3-moe", "--all2all-backend", "hierarchical", "--no-dp-align",
                                    "--dp-migrate", "reprefill", *ALIGN)
    try:
        check_exact(server, "tiny-qwen3-moe")
        assert metric(server, "elastic_ep_dp_migrations_total", mode="reprefill") > 0
    finally:
        stop(server, agent)


@pytest.fixture(scope="module")
def hierarchical_dbo(tmp_path_factory):
    server, agent = start_two_nodes(tmp_path_factory.mktemp("longtail"), "tiny-deepseek-v3", "--all2all-backend",
                                    "hierarchical", "--enable-dbo", "--redundant-experts", "16", "--enable-eplb",
                                    "--eplb-interval", "16", "--eplb-threshold", "1.01", "--scale-drain-timeout-s",
                                    "1.0", *ALIGN)
    yield server
    stop(server, agent)


def test_hierarchical_with_dbo_kv_moves_and_eplb_is_exact(hierarchical_dbo):
    server = hierarchical_dbo
    check_exact(server, "tiny-deepseek-v3")
    assert metric(server, "elastic_ep_dp_migrations_total", mode="kv") > 0
    cluster = server.cluster()
    assert any(e["kind"] == "epoch" and str(e.get("reason", "")).startswith("eplb") for e in cluster["events"])
    # only the two leaders cross, each to the other: at most 2 sends per collective, 3 collectives per
    # layer (B counts, B rows, B'), 3 MoE layers, 2 micro-batches; flat sends 4 x 2 per collective
    per_step = metric(server, "elastic_ep_all2all_remote_messages_total") / cluster["step"]
    assert 0 < per_step <= 2 * 3 * 3 * 2


def test_scaling_down_and_up_rebuilds_the_host_groups_under_load(hierarchical_dbo):
    server = hierarchical_dbo
    with reference_load(server, "tiny-deepseek-v3", threads=4) as load:
        for size, nodes in ((3, {"node0": [0, 1], "node1": [2]}), (4, {"node0": [0, 1], "node1": [2, 3]})):
            assert server.http.post("/scale_elastic_ep", json={"new_ep_size": size}).status_code == 200
            server.wait_for(lambda c, size=size: c["ready"] and len(c["members"]) == size
                            and not c["scale"]["is_scaling_elastic_ep"], timeout_s=120, what=f"serving at {size} ranks")
            assert server.cluster()["data_plane"]["nodes"] == nodes
            done = load.done
            while load.done < done + 4:
                time.sleep(0.1)
    assert not load.failures, load.failures[:3]


@pytest.mark.parametrize("victim", [3, 0], ids=["rank-on-node1", "leader-of-node0"])
def test_kill_mid_stream_with_dbo_and_hierarchical_recovers_exactly(hierarchical_dbo, victim):
    server = hierarchical_dbo
    before = server.wait_full_group(4, 60)
    pid = server.pids()[victim]
    results = streams_with_fault(server.url, lambda: os.kill(pid, signal.SIGKILL), PROMPTS, 32, temperature=0)
    assert [r.text for r in results] == list(reference("tiny-deepseek-v3", tuple(PROMPTS), 32))
    during = server.wait_for(lambda c: any(e["kind"] == "recovered" and e.get("epoch", -1) > before["epoch"]
                                           for e in c["events"]), what="the recovery")
    recovered = next(e for e in during["events"] if e["kind"] == "recovered" and e["epoch"] > before["epoch"])
    assert victim in recovered["culprits"]
    back = server.wait_full_group(4, 120)  # restarted after --restart-delay-s: the host groups are whole again
    assert back["data_plane"]["nodes"] == {"node0": [0, 1], "node1": [2, 3]}
    assert serve_requests(server) == list(expected_texts("tiny-deepseek-v3"))
