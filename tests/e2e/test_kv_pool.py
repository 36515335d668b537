"""The KV pool through `elastic-ep serve`: a pool too small for every request at once preempts and
recomputes with outputs unchanged, a shared prefix is served from cached blocks with the tokens of
a cold run (and one in flight is waited for, as /metrics counts), and a request no pool can hold is
a 400."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import PROMPTS, concurrently, reference

MODEL = "tiny-qwen3-moe"
BLOCKS = 24  # of 4 tokens per rank: ~100 tokens, about two of these requests at their longest
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def small_pool(server_factory):
    return server_factory("--model", MODEL, "--ep-size", "2", "--max-model-len", "256", "--block-size", "4",
                          "--num-gpu-blocks-override", str(BLOCKS))


def metric(server, name: str, **labels) -> float:
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise AssertionError(f"no {name}{labels} in /metrics")


def test_the_pool_is_sized_as_asked_and_cluster_says_what_it_holds(small_pool):
    pools = small_pool.cluster()["kv_cache"]["ranks"]
    assert {r: (p["blocks"], p["tokens"]) for r, p in pools.items()} == {"0": (BLOCKS, 96), "1": (BLOCKS, 96)}


def test_a_burst_beyond_the_pool_preempts_and_every_output_is_that_of_generate(small_pool):
    prompts = PROMPTS * 2
    expected = reference(MODEL, tuple(PROMPTS), MAX_TOKENS)
    before = metric(small_pool, "elastic_ep_num_preemptions_total")
    texts = concurrently(lambda p: small_pool.complete(p, MAX_TOKENS, temperature=0), prompts)
    assert texts == list(expected) * 2
    assert metric(small_pool, "elastic_ep_num_preemptions_total") > before
    assert 0 <= metric(small_pool, "elastic_ep_kv_cache_usage_perc") <= 1
    assert 0 <= metric(small_pool, "elastic_ep_kv_cache_usage_perc", rank="1") <= 1


def test_a_shared_prefix_is_served_from_cached_blocks_with_the_tokens_of_a_cold_run(small_pool):
    prefix = "The quick brown fox jumps over the lazy dog, " * 2
    prompt = prefix + "and then"
    fresh = "A slow green turtle walks under the busy stone bridge, " * 2 + "so"
    expected = reference(MODEL, (prompt, fresh), 8)
    # six choices of one new prompt admitted at once: the first computes its prefix, and a later one
    # placed on that rank waits for it (serve's prefix wait) instead of computing it again
    waits, waited_s = metric(small_pool, "elastic_ep_prefix_waits_total"), metric(
        small_pool, "elastic_ep_prefix_wait_seconds_total")
    body = {"model": small_pool.model, "prompt": fresh, "max_tokens": 8, "temperature": 0, "n": 6}
    r = small_pool.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [expected[1]] * 6
    assert metric(small_pool, "elastic_ep_prefix_waits_total") > waits
    assert metric(small_pool, "elastic_ep_prefix_wait_seconds_total") > waited_s
    small_pool.complete(prefix + "while", 2, temperature=0)
    hits = metric(small_pool, "elastic_ep_prefix_cache_hits_total")
    queries = metric(small_pool, "elastic_ep_prefix_cache_queries_total")
    assert small_pool.complete(prompt, 8, temperature=0) == expected[0]
    assert metric(small_pool, "elastic_ep_prefix_cache_hits_total") - hits >= 32
    assert metric(small_pool, "elastic_ep_prefix_cache_queries_total") > queries


def test_a_request_no_pool_can_hold_is_a_400_naming_the_sizes(small_pool):
    body = {"model": small_pool.model, "prompt": PROMPTS[0], "max_tokens": 200}
    r = small_pool.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert f"a rank's KV pool holds {BLOCKS}" in r.json()["error"]["message"]
    assert small_pool.complete(PROMPTS[0], 4, temperature=0)
