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


def test_the_prefix_backend_keeps_its_requests_until_the_load_is_clearly_uneven():
    order = URLS[:3]
    idle = {u: Load() for u in order}
    assert choose(order, idle, Limits()) == order[0]
    # 8 above the least loaded (0) with this request is not over balance_abs (8) ...
    assert choose(order, {**idle, order[0]: Load(running=7)}, Limits()) == order[0]
    # ... 9 is, and the next in the prefix's order takes it
    assert choose(order, {**idle, order[0]: Load(running=8)}, Limits()) == order[1]
    # over the absolute gap but not 1.5x the least loaded: it stays
    busy = {order[0]: Load(running=30), order[1]: Load(running=22), order[2]: Load(running=22)}
    assert choose(order, busy, Limits()) == order[0]  # 31 - 22 > 8, but 31 < 1.5 x 22
    assert choose(order, {**busy, order[0]: Load(running=33)}, Limits()) == order[1]
    # this router's own open requests count when the metrics lag behind them
    assert choose(order, {**idle, order[0]: Load(open_here=8)}, Limits()) == order[1]
    # a spilled request skips a next backend that is over the line too
    assert choose(order, {**idle, order[0]: Load(running=9), order[1]: Load(running=9)}, Limits()) == order[2]
    assert choose(order, {**idle, order[0]: Load(running=1)}, Limits(balance_abs=0)) == order[1]


def test_an_interleaved_load_keeps_each_prefix_on_its_backend():
    """24 prefixes over 4 backends, 16 requests open at a time in shuffled order: almost every
    request goes to its prefix's backend (6 of 384 move) although the hash gives one backend 11
    of the prefixes and another 2 (a bound at 1.5x the mean load, the rule before, moved 75)."""
    import random

    keys = [prefix_key(f"[{k}] {SYSTEM}".encode()) for k in range(24)]
    homes = {k: rendezvous_order(key, URLS)[0] for k, key in enumerate(keys)}
    jobs = [k for k in range(24) for _ in range(16)]
    random.Random(0).shuffle(jobs)
    open_: list[tuple[int, str]] = []
    moved = 0
    for k in jobs:
        if len(open_) == 16:
            open_.pop(random.Random(k).randrange(16))
        loads = {u: Load(open_here=sum(1 for _, w in open_ if w == u)) for u in URLS}
        url = choose(rendezvous_order(keys[k], URLS), loads, Limits())
        moved += url != homes[k]
        open_.append((k, url))
    shares = Counter(homes.values())
    assert max(shares.values()) >= 1.5 * min(shares.values())  # the hash is uneven for these keys
    assert moved <= len(jobs) * 0.02


def test_saturated_backends_take_nothing_and_kv_usage_only_orders_the_spill():
    order = URLS[:3]
    limits = Limits(max_open=2, max_waiting=3)
    assert choose(order[:2], {order[0]: Load(open_here=2), order[1]: Load()}, limits) == order[1]
    assert choose(order[:2], {order[0]: Load(waiting=3), order[1]: Load(waiting=3)}, limits) is None
    # a full KV cache does not move a request off its prefix's backend ...
    assert choose(order, {u: Load(kv_usage=0.97 if u == order[0] else 0.0) for u in order}, Limits()) == order[0]
    # ... but a spilled one goes past the next backend when that one's KV cache is full
    loads = {order[0]: Load(running=9), order[1]: Load(kv_usage=0.97), order[2]: Load()}
    assert choose(order, loads, Limits()) == order[2]
    loads[order[2]] = Load(kv_usage=0.99)
    assert choose(order, loads, Limits()) == order[1]


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
