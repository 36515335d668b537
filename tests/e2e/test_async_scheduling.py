"""Overlap scheduling end to end (serve --async-scheduling): 4 real ranks, concurrent streams that
end by length at different steps, by a stop token mid-run, by a stop string, seeded sampling among
them, arriving one after another. Every output is token for token the one of a server without the
flag; the prepared steps were sent (some with the requests that ended taken out). A rank killed
mid-stream: every output equals the fault-free run. With plans and results through the agents: the
same outputs."""

from __future__ import annotations

import os
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.load import streams_with_fault

from .conftest import PROMPTS, Server, concurrently, reference

MODEL = "tiny-deepseek-v3"
MAX_TOKENS = 48
SERVE_ARGS = ("--model", MODEL, "--ep-size", "4", "--redundant-experts", "16", "--restart-delay-s", "1.0",
              "--admission-timeout-s", "2", "--straggler-policy", "off")


def prepared(server: Server, outcome: str) -> float:
    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return sum(s.value for f in families if f.name == "elastic_ep_prepared_steps" for s in f.samples
               if s.name.endswith("_total") and s.labels.get("outcome") == outcome)


def the_mix(server: Server) -> list[tuple[float, str, int, dict]]:
    """(start delay s, prompt, max_tokens, extra) of each stream: greedy ones ending by length at
    8..48 tokens, two seeded samples, one ending by a stop token its greedy output samples at its
    10th token, one by a stop string from the middle of its greedy text. The stop token and string
    are taken from this server's greedy outputs."""
    tokens = server.client.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=30, temperature=0,
                                              extra_body={"return_token_ids": True}).choices[0].token_ids
    text = server.complete(PROMPTS[1], 30, temperature=0)
    mix = [(0.05 * i, p, 8 * (i + 1), {"temperature": 0}) for i, p in enumerate(PROMPTS)]
    mix += [(0.1, PROMPTS[0], 30, {"temperature": 0.8, "seed": 3}), (0.3, PROMPTS[2], 37, {"temperature": 1.0,
                                                                                          "seed": 11})]
    mix += [(0.15, PROMPTS[3], 30, {"temperature": 0, "extra_body": {"stop_token_ids": [tokens[9]]}})]
    mix += [(0.2, PROMPTS[1], 30, {"temperature": 0, "stop": [text[len(text) // 2:len(text) // 2 + 3]]})]
    return mix


def stream_mix(server: Server, mix: list[tuple[float, str, int, dict]]) -> list[tuple[list[int], str, str]]:
    """(token ids, text, finish reason) of each stream of `mix`, streamed concurrently."""
    def one(item: tuple[float, str, int, dict]) -> tuple[list[int], str, str]:
        delay_s, prompt, max_tokens, extra = item
        extra = {**extra, "extra_body": {**extra.get("extra_body", {}), "return_token_ids": True}}
        time.sleep(delay_s)
        ids, parts, reason = [], [], None
        for chunk in server.client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                                      stream=True, **extra):
            if chunk.choices:
                ids += chunk.choices[0].token_ids or []
                parts.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
        return ids, "".join(parts), reason
    return concurrently(one, mix)


@pytest.fixture(scope="module")
def without_flag(server_factory) -> tuple[list, list]:
    """The mix and its outputs on a server without --async-scheduling (stopped after)."""
    server = server_factory(*SERVE_ARGS)
    try:
        mix = the_mix(server)
        return mix, stream_mix(server, mix)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(server_factory, without_flag):
    return server_factory(*SERVE_ARGS, "--async-scheduling")


def test_outputs_are_token_for_token_those_without_the_flag(server, without_flag):
    mix, expected = without_flag
    assert [reason for _, _, reason in expected[-2:]] == ["stop", "stop"] and len(expected[-2][0]) < 30
    assert {reason for _, _, reason in expected[:-2]} == {"length"}
    assert mix == the_mix(server)  # the same stop token and string
    assert stream_mix(server, mix) == expected
    # sent as sealed, and with the rows of requests that ended taken out (the drops on arrival depend on
    # when a request lands: tests/control/serving/test_step_loop.py)
    assert prepared(server, "sent") > 20 and prepared(server, "rebuilt") > 0


def kill_mid_stream(server: Server, index: int) -> dict:
    """SIGKILL the server's `index`th rank process once every greedy stream of PROMPTS has its first
    chunk: every output is the fault-free reference; returns /cluster once the recovery is recorded."""
    pid = server.pids()[index]
    results = streams_with_fault(server.url, lambda: os.kill(pid, signal.SIGKILL), PROMPTS, MAX_TOKENS,
                                 temperature=0)
    assert [r.text for r in results] == list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    return server.wait_for(lambda c: any(e["kind"] == "recovered" for e in c["events"]), timeout_s=10,
                           what="a recovery")


def test_a_rank_killed_mid_stream_leaves_the_outputs_exact(server):
    server.wait_full_group(4)
    sent = prepared(server, "sent")
    cluster = kill_mid_stream(server, 1)
    assert cluster["epoch"] > 0 and prepared(server, "sent") > sent


def test_with_plans_and_results_through_the_agents_the_outputs_are_the_same(server_factory, without_flag):
    """--async-scheduling with --step-plans-via agent and --step-results-via agent: the prepared
    steps are sealed per node at the send and relayed by the agents; token for token the same."""
    mix, expected = without_flag
    server = server_factory(*SERVE_ARGS, "--async-scheduling", "--step-plans-via", "agent",
                            "--step-results-via", "agent")
    try:
        assert stream_mix(server, mix) == expected
        plans_out = server.cluster()["control_times"]["plans_out"]
        assert prepared(server, "sent") > 20 and plans_out["relayed"] > 10 * plans_out["direct"]
    finally:
        server.stop()


def test_steps_sent_ahead_give_the_same_outputs_and_a_kill_mid_stream_leaves_them_exact(server_factory, without_flag):
    """--send-ahead-steps 4: each step prepared while one runs is sent before that one completes, the
    ranks (real workers, plans and results through their agents) going straight from one step to the
    next; the requests that end are computed once more and their tokens dropped. Token for token the
    outputs of a server without overlap; a rank killed mid-stream gives up the step sent ahead with the
    interrupted one, and the outputs stay exact."""
    mix, expected = without_flag
    server = server_factory(*SERVE_ARGS, "--async-scheduling", "--send-ahead-steps", "4", "--step-plans-via",
                            "agent", "--step-results-via", "agent")
    try:
        assert stream_mix(server, mix) == expected
        ahead = prepared(server, "ahead")
        assert ahead > 10  # 36 in a run here: the requests' arrivals end runs of steps ahead
        cluster = kill_mid_stream(server, 2)
        assert cluster["epoch"] > 0 and prepared(server, "ahead") > ahead
        assert any(e["kind"] == "fault" and "SIGKILL" in e["message"] for e in cluster["events"])
    finally:
        server.stop()
