"""GET /prefix_keys: the routers' prefix keys an instance was sent, counted per key, bounded."""

from __future__ import annotations

import httpx
from scripted_engine import MODEL

from elastic_ep.serve.prefix_keys import HEADER, PrefixKeys


def test_the_keys_routers_name_are_counted_and_listed_and_anything_else_is_ignored(served):
    key, other = "ab" * 16, "cd" * 16
    before = {k: n for k, n, _ in httpx.get(f"{served.url}/prefix_keys").json()["keys"]}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    for name in (key, key, other, "not a key", key.upper(), key + "00"):
        assert httpx.post(f"{served.url}/v1/completions", json=body, headers={HEADER: name}).status_code == 200
    assert httpx.post(f"{served.url}/v1/completions", json=body).status_code == 200
    listed = httpx.get(f"{served.url}/prefix_keys").json()
    counts = {k: n for k, n, _ in listed["keys"]}
    assert {k: counts[k] - before.get(k, 0) for k in counts} == {key: 2, other: 1}
    assert [k for k, _, _ in listed["keys"]][-2:] == [key, other]  # most recent last
    assert all(age >= 0 for _, _, age in listed["keys"]) and listed["capacity"] > 0


def test_the_least_recently_seen_key_is_forgotten_first():
    now = [0.0]
    keys = PrefixKeys(capacity=2, clock=lambda: now[0])
    for k in ("aa", "bb", "aa", "cc"):
        now[0] += 1
        keys.record(k * 16)
    assert keys.view() == [("aa" * 16, 2, 1.0), ("cc" * 16, 1, 0.0)]
