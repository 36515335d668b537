"""`elastic-ep serve` end to end: real processes, the real `openai` client.

Greedy and seeded outputs must equal single-process `elastic-ep generate` token for token (as
text), at EP 1, 2 and 4, with redundant experts and after an EPLB rebalance, on both tiny
architectures; every step runs a batch shape its epoch warmed up (the readiness gate); with
--step-results-via agent too.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.commands.eplb import read_load

from .conftest import PROMPTS, concurrently, leave_mid_stream, reference

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def ep4(server_factory, tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("records")
    return server_factory(
        "--model", "tiny-deepseek-v3", "--ep-size", "4", "--redundant-experts", "4", "--max-model-len", "256",
        "--enable-eplb", "--eplb-interval", "16", "--eplb-threshold", "1.01", "--record-dir", str(record_dir),
    )


def test_greedy_and_streaming_match_generate_then_eplb_rebalances_and_output_stays_exact(ep4):
    expected = reference("tiny-deepseek-v3", tuple(PROMPTS), MAX_TOKENS)
    texts = concurrently(lambda p: ep4.complete(p, MAX_TOKENS, temperature=0), PROMPTS)
    assert texts == list(expected)
    streamed = concurrently(lambda p: ep4.stream(p, MAX_TOKENS, temperature=0), PROMPTS[:3])
    assert streamed == list(expected[:3])

    cluster = ep4.wait_for(
        lambda c: any(e["kind"] == "epoch" and str(e.get("reason", "")).startswith("eplb") for e in c["events"]),
        timeout_s=5, what="an EPLB rebalance",
    )
    assert cluster["epoch"] >= 1
    again = concurrently(lambda p: ep4.complete(p, MAX_TOKENS, temperature=0), PROMPTS)
    assert again == list(expected)

    # the readiness gate covers every step: each rank's tokens padded to a shape it warmed up, and
    # every epoch the rebalances formed warmed up again before its first step
    # a rebalance may form an epoch just as the last request ends: its warm-up then follows it
    cluster = ep4.wait_for(lambda c: c["cold_start"]["warmup"]["epoch"] == c["epoch"], timeout_s=10,
                           what="the last epoch's warm-up")
    warmup = cluster["cold_start"]["warmup"]
    assert warmup["unwarmed_steps"] == 0, warmup
    shapes = {int(s) for s in warmup["steps_by_shape"]}
    assert shapes <= set(warmup["shapes"]) and len(shapes) >= 3, warmup  # decode batches and prefills
    events = ep4.http.get("/cluster", params={"events": 0}).json()["events"]
    assert set(range(cluster["epoch"] + 1)) <= {e["epoch"] for e in events if e["kind"] == "warmup"}


def test_seeded_sampling_matches_generate(ep4):
    expected = reference("tiny-deepseek-v3", tuple(PROMPTS[:4]), MAX_TOKENS, 0.8, 7)
    texts = concurrently(lambda p: ep4.complete(p, MAX_TOKENS, temperature=0.8, seed=7), PROMPTS[:4])
    assert texts == list(expected)


def test_bad_inputs_get_4xx_with_an_openai_error_and_the_server_keeps_serving(ep4):
    model = ep4.model
    bad = [
        ("malformed JSON", b"{not json"),
        ("wrong type", json.dumps({"model": model, "prompt": "hi", "max_tokens": "many"}).encode()),
        ("unknown model", json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()),
        ("prompt over --max-model-len", json.dumps({"model": model, "prompt": "word " * 400}).encode()),
        ("n = 0", json.dumps({"model": model, "prompt": "hi", "n": 0}).encode()),
        ("temperature NaN", b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % model.encode()),
        ("tools", json.dumps({"model": model, "prompt": "hi", "tools": [{"type": "function"}]}).encode()),
    ]
    for what, body in bad:
        r = ep4.http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
        assert "message" in r.json()["error"], what
    assert ep4.complete(PROMPTS[0], 4, temperature=0)
    assert ep4.http.get("/health").status_code == 200


def test_client_disconnect_mid_stream_frees_its_request(ep4):
    leave_mid_stream(ep4, PROMPTS[1])
    ep4.wait_for(lambda c: sum(rank["requests"] for rank in c["ranks"]) == 0, timeout_s=10,
                 what="the aborted request freed")


def test_metrics_parse_and_have_per_rank_series(ep4):
    ep4.complete(PROMPTS[0], 4, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(ep4.http.get("/metrics").text)}
    for name in ("elastic_ep_rank_step_seconds", "elastic_ep_rank_collective_wait_seconds",
                 "elastic_ep_expert_load_imbalance"):
        ranks = {s.labels.get("rank") for s in families[name].samples}
        assert {"0", "1", "2", "3"} <= ranks, name
    assert families["elastic_ep_dp_token_imbalance"].samples[0].value >= 1.0
    assert families["elastic_ep_epoch"].samples[0].value >= 0


def test_cluster_json_and_expert_distribution_recorder(ep4):
    cluster = ep4.cluster()
    assert [r["rank_id"] for r in cluster["ranks"]] == [0, 1, 2, 3]
    for rank in cluster["ranks"]:
        assert rank["state"] == "serving" and rank["pid"] > 0 and rank["node"]
        assert rank["slots"]["used"] == rank["slots"]["total"]
    assert cluster["deadlines"]["heartbeat_timeout_s"] > 0
    assert ep4.http.post("/start_expert_distribution_record").status_code == 200
    ep4.complete(PROMPTS[2], 8, temperature=0)
    assert ep4.http.post("/stop_expert_distribution_record").status_code == 200
    dump = ep4.http.post("/dump_expert_distribution_record").json()
    load = read_load(Path(dump["path"]))
    assert load.shape == (dump["layers"], dump["experts"]) and load.sum() == dump["tokens"] > 0


@pytest.mark.parametrize(
    "model,ep_size,redundant",
    [("tiny-deepseek-v3", 1, 0), ("tiny-qwen3-moe", 1, 0), ("tiny-qwen3-moe", 2, 0), ("tiny-qwen3-moe", 4, 4)],
)
def test_greedy_matches_generate_at_each_ep_size_and_ctrl_c_stops_everything(
    server_factory, model, ep_size, redundant
):
    server = server_factory("--model", model, "--ep-size", str(ep_size), "--redundant-experts", str(redundant))
    texts = concurrently(lambda p: server.complete(p, MAX_TOKENS, temperature=0), PROMPTS[:4])
    assert texts == list(reference(model, tuple(PROMPTS[:4]), MAX_TOKENS))

    workers = list(server.pids().values())
    backups = server.wait_for(lambda c: any(e["kind"] == "backup" for e in c["events"]), what="the backup")
    backup_files = [e["path"] for e in backups["events"] if e["kind"] == "backup"]
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers):
        assert time.monotonic() < deadline, "workers outlived the server"
        time.sleep(0.1)
    assert backup_files and not any(Path(f).exists() for f in backup_files)


def test_bfloat16_serving_agrees_with_generate_in_bfloat16(server_factory):
    """--dtype bfloat16 serves in bf16 end to end (weights, KV cache, experts, backup). Greedy
    tokens agree with the single-process engine in bf16 for the first tokens; later ones may part
    at a near-tie, since bf16 matmuls on the CPU round differently with the batch shape."""
    server = server_factory("--model", "tiny-deepseek-v3", "--ep-size", "2", "--dtype", "bfloat16")
    served = concurrently(lambda p: server.complete(p, 8, temperature=0), PROMPTS)
    assert served == list(reference("tiny-deepseek-v3", tuple(PROMPTS), 8, dtype="bfloat16"))
    assert served != list(reference("tiny-deepseek-v3", tuple(PROMPTS), 8))  # it did not run in float32


def test_step_results_gathered_by_the_agent_are_exact_and_none_is_lost(server_factory):
    """--step-results-via agent: the ranks' results reach the controller in their node's
    `NodeStepResults`, none on its own, none asked for again (a lost one would be resent after the
    result deadline and the output still exact), and the output is generate's."""
    server = server_factory("--model", "tiny-qwen3-moe", "--ep-size", "4", "--step-results-via", "agent")
    texts = concurrently(lambda p: server.complete(p, MAX_TOKENS, temperature=0), PROMPTS[:4])
    assert texts == list(reference("tiny-qwen3-moe", tuple(PROMPTS[:4]), MAX_TOKENS))
    handled = server.cluster()["control_times"]["handled"]
    # every result came in a node's frame (how many frames a step took varies with the load: 16-19 were
    # seen for 20 tokens on a loaded machine, so the count is not pinned)
    assert handled.get("NodeStepResults", 0) > 0 and handled.get("StepResult", 0) == 0, handled
    families = {f.name: f for f in text_string_to_metric_families(server.http.get("/metrics").text)}
    lost = families.get("elastic_ep_lost_step_results")
    assert lost is None or sum(s.value for s in lost.samples if s.name.endswith("_total")) == 0
