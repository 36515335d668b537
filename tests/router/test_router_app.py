"""The router's HTTP behaviour over in-process serve instances: where requests go (not to an
instance that is not ready, to one added at run time, the same place from two routers), and
what a client gets when it cannot be served (the backend's 400, 503 or 429 with Retry-After,
never another 5xx)."""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter

import httpx

from elastic_ep.control.api import Readiness
from elastic_ep.router.config import RouterConfig
from elastic_ep.router.scoring import Limits

FAST = {"poll_interval_s": 0.05}


def complete(url: str, prompt: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4, **body}, timeout=30)


def served_by(instances, request_ids=None) -> dict[str, int]:
    return {i.url: len(i.engine.requests) for i in instances}


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_an_instance_that_is_not_ready_gets_nothing(instances, routers):
    a, b = instances(2)
    a.engine.ready = Readiness(False, "2 of 4 ranks recovering")
    router = routers(RouterConfig(backends=(a.url, b.url), **FAST))
    for i in range(20):
        assert complete(router.url, f"prompt number {i}").status_code == 200
    assert served_by([a, b]) == {a.url: 0, b.url: 20}
    a.engine.ready = Readiness(True)
    wait_until(lambda: all(x["ready"] for x in httpx.get(f"{router.url}/backends").json()))
    for i in range(20):  # the 20 prefixes b holds stay there; new ones go to a, which holds none
        complete(router.url, f"prompt number {i}")
        complete(router.url, f"another prompt {i}")
    assert served_by([a, b]) == {a.url: 20, b.url: 40}


def test_a_backend_added_at_run_time_takes_load_and_a_removed_one_takes_none(instances, routers):
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url,), **FAST))
    added = httpx.post(f"{router.url}/backends", json={"url": b.url}, timeout=10)
    assert added.status_code == 200 and added.json()["ready"]
    for i in range(30):
        assert complete(router.url, f"spread {i}").status_code == 200
    assert len(b.engine.requests) >= 5
    assert httpx.request("DELETE", f"{router.url}/backends", json={"url": b.url}).status_code == 200
    before = len(b.engine.requests)
    for i in range(10):
        assert complete(router.url, f"after {i}").status_code == 200
    assert len(b.engine.requests) == before
    missing = httpx.request("DELETE", f"{router.url}/backends", json={"url": b.url})
    assert missing.status_code == 404
    assert httpx.post(f"{router.url}/backends", json={"url": "ftp://x"}).status_code == 400
    assert httpx.post(f"{router.url}/backends", json={"address": "x"}).json()["error"]["param"] == "url"


def test_two_routers_send_each_prefix_to_the_same_instance(instances, routers):
    backends = instances(3)
    urls = tuple(i.url for i in backends)
    key = {"block_bytes": 16, "affinity_blocks": 4}  # the scripted engine holds 128 tokens
    one = routers(RouterConfig(backends=urls, **key, **FAST))
    two = routers(RouterConfig(backends=tuple(reversed(urls)), **key, **FAST))
    system = "You are a terse assistant; answer every question in one word."
    placed = {}
    for k in range(6):
        prompts = [f"[{k}] {system} question {q}" for q in range(3)]
        for router in (one, two):
            for p in prompts:
                before = {i.url: len(i.engine.requests) for i in backends}
                assert complete(router.url, p).status_code == 200
                [where] = [i.url for i in backends if len(i.engine.requests) > before[i.url]]
                placed.setdefault(k, set()).add(where)
    assert all(len(places) == 1 for places in placed.values()), placed
    # each new prefix on the instance with the fewest (router/placement.py): 2 each, not the hash's split
    assert sorted(Counter(next(iter(p)) for p in placed.values()).values()) == [2, 2, 2]


def test_bad_input_is_the_backends_400(instances, routers):
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url, b.url), **FAST))
    r = complete(router.url, "x", max_tokens="many")
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{router.url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": [], "stream": True}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_no_ready_backend_is_503_with_retry_after(instances, routers):
    (a,) = instances(1)
    a.engine.ready = Readiness(False, "starting")
    router = routers(RouterConfig(backends=(a.url,), retry_after_s=3, **FAST))
    r = complete(router.url, "anyone?")
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "no_backend"
    assert httpx.get(f"{router.url}/ready").status_code == 503
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_saturated_backends_queue_then_429_never_5xx(instances, routers):
    a, b = instances(2)
    limits = Limits(max_open=1)
    router = routers(RouterConfig(backends=(a.url, b.url), limits=limits, queue_size=2, queue_timeout_s=20,
                                  **FAST))
    body = {"max_tokens": 40}  # 20 events of 50 ms: the first two still run when the last arrive
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: complete(router.url, f"[slow] {i}", **body), range(8)))
    statuses = sorted(r.status_code for r in answers)
    # two run, two wait in the queue and run after them, four are refused
    assert statuses == [200] * 4 + [429] * 4, statuses
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "saturated"


def test_a_request_whose_instance_is_gone_before_it_starts_goes_elsewhere(instances, routers):
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url, b.url), poll_interval_s=60))
    a.stop()  # the router still believes it ready: the next poll is a minute away
    for i in range(6):
        assert complete(router.url, f"elsewhere {i}").status_code == 200
        streamed = httpx.post(f"{router.url}/v1/completions", timeout=30,
                              json={"prompt": f"s {i}", "max_tokens": 3, "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert len(b.engine.requests) == 12


def test_the_router_checks_its_key_and_sends_the_backends_theirs(instances, routers):
    (a,) = instances(1)
    router = routers(RouterConfig(backends=(a.url,), api_key="sesame", backend_api_key="inner", **FAST))
    assert complete(router.url, "x").status_code == 401
    assert httpx.post(f"{router.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                    headers={"Authorization": "Bearer sesame"}, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(f"{router.url}/health").status_code == 200  # operator routes need no key
    assert httpx.post(f"{router.url}/backends", json={"url": "http://10.9.9.9:1"}).status_code == 401
    assert router.core.backend_headers(_FakeRequest({"authorization": "Bearer sesame"}))["authorization"] == (
        "Bearer inner")


def test_tokenize_detokenize_and_models_pass_through(instances, routers):
    a, b = instances(2)
    router = routers(RouterConfig(backends=(a.url, b.url), **FAST))
    ids = httpx.post(f"{router.url}/tokenize", json={"prompt": "héllo"}).json()["tokens"]
    assert httpx.post(f"{router.url}/detokenize", json={"tokens": ids}).json()["prompt"] == "héllo"
    assert httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"] == "tiny-test"
    r = httpx.post(f"{router.url}/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400


class _FakeRequest:
    def __init__(self, headers: dict[str, str]):
        self.headers = headers


def test_the_router_starts_without_torch():
    """It forwards requests only: loading torch would cost every start seconds of CPU."""
    import subprocess
    import sys

    code = "import sys, elastic_ep.commands.router, elastic_ep.router.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
