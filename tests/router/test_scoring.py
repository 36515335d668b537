"""Scoring as pure functions: prefix blocks, rendezvous order, bounded load, saturation."""

from __future__ import annotations

from collections import Counter

from elastic_ep.router.backends import parse_metrics
from elastic_ep.router.scoring import (
    Limits,
    Load,
    block_hashes,
    choose,
    prefix_key,
    prompt_material,
    rendezvous_order,
)

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
SYSTEM = "You are a careful assistant. " * 20  # 580 bytes: more than the default 512-byte key


def test_a_block_hash_names_the_whole_prefix_up_to_it():
    a = block_hashes(b"x" * 64 + b"y" * 64 + b"z" * 10, 64)
    b = block_hashes(b"x" * 64 + b"w" * 64, 64)
    c = block_hashes(b"w" * 64 + b"y" * 64, 64)
    assert len(a) == 2  # the partial tail is no block
    assert a[0] == b[0] and a[1] != b[1]
    assert c[1] != a[1]  # same second block, different prefix


def test_prompts_sharing_the_keyed_prefix_share_a_key_and_others_do_not():
    one = prefix_key(f"{SYSTEM} what is 2+2?".encode())
    two = prefix_key(f"{SYSTEM} name a river".encode())
    other = prefix_key(f"{SYSTEM.upper()} what is 2+2?".encode())
    assert one == two != other
    assert prefix_key(b"short a") != prefix_key(b"short b")


def test_a_chat_is_named_by_its_messages_before_the_last():
    first = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    second = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "bye"}]}
    assert prompt_material("chat", first) == prompt_material("chat", second)
    assert prompt_material("completion", {"prompt": ["a", "b"]}) == b"a"
    assert prompt_material("completion", {"prompt": [1, 2]}) != prompt_material("completion", {"prompt": [1, 3]})


def test_rendezvous_order_is_the_same_everywhere_and_stable_under_removal():
    key = prefix_key(SYSTEM.encode())
    order = rendezvous_order(key, URLS)
    assert order == rendezvous_order(key, list(reversed(URLS)))
    without = rendezvous_order(key, [u for u in URLS if u != order[1]])
    assert without == [u for u in order if u != order[1]]


def test_keys_spread_over_backends():
    wins = Counter(rendezvous_order(prefix_key(f"prompt {i}".encode()), URLS)[0] for i in range(400))
    assert set(wins) == set(URLS)
    assert min(wins.values()) > 400 / len(URLS) * 0.6


def test_the_first_backend_in_order_wins_until_its_load_passes_the_bound():
    order = URLS[:3]
    idle = {u: Load() for u in order}
    assert choose(order, idle, Limits()) == order[0]
    # at low load the prefix's backend keeps it: the bound is at least load_floor (4)
    assert choose(order, {**idle, order[0]: Load(running=3)}, Limits()) == order[0]
    # bound: ceil(1.5 x (8 + 1) / 3) = 5 requests; the first would hold 9
    assert choose(order, {**idle, order[0]: Load(running=8)}, Limits()) == order[1]
    # max(4, ceil(1.5 x (4 + 1) / 3)) = 4: 4 + 1 is over, but at 1.5 x more slack it is not
    assert choose(order, {**idle, order[0]: Load(running=4)}, Limits()) == order[1]
    assert choose(order, {**idle, order[0]: Load(running=4)}, Limits(load_slack=2.0)) == order[0]
    # this router's own open requests count when the metrics lag behind them
    assert choose(order, {**idle, order[0]: Load(open_here=8)}, Limits()) == order[1]


def test_saturated_backends_take_nothing_and_a_full_kv_cache_is_passed_over():
    order = URLS[:2]
    limits = Limits(max_open=2, max_waiting=3)
    assert choose(order, {order[0]: Load(open_here=2), order[1]: Load()}, limits) == order[1]
    assert choose(order, {order[0]: Load(waiting=3), order[1]: Load(waiting=3)}, limits) is None
    assert choose(order, {order[0]: Load(kv_usage=0.97), order[1]: Load()}, limits) == order[1]
    assert choose(order, {order[0]: Load(kv_usage=0.97), order[1]: Load(kv_usage=0.99)}, limits) == order[0]


def test_metrics_are_read_by_name_and_missing_ones_are_zero():
    text = """# TYPE elastic_ep_num_requests_running gauge
elastic_ep_num_requests_running 3.0
# TYPE elastic_ep_num_requests_waiting gauge
elastic_ep_num_requests_waiting 7.0
# TYPE elastic_ep_prefix_cache_hits counter
elastic_ep_prefix_cache_hits_total 40.0
elastic_ep_prefix_cache_hits_created 1.7e9
# TYPE elastic_ep_prefix_cache_queries counter
elastic_ep_prefix_cache_queries_total 100.0
"""
    m = parse_metrics(text)
    assert (m.running, m.waiting, m.kv_usage, m.prefix_hits, m.prefix_queries) == (3, 7, 0, 40, 100)
    assert "kv_usage" not in m.present and "prefix_hits" in m.present
