"""Sleep and wake end to end on a real 2-rank server: each level gives resident memory back on
every rank, requests while asleep are 503 with Retry-After, the sleep-state metric follows, and
after a wake the next request's output equals the fault-free run's."""

from __future__ import annotations

import pytest

from .conftest import PROMPTS, reference

MODEL = "tiny-deepseek-v3"


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--model", MODEL, "--ep-size", "2", "--redundant-experts", "0")


def sleep_state(server) -> float:
    line = next(line for line in server.http.get("/metrics").text.splitlines()
                if line.startswith("elastic_ep_engine_sleep_state "))
    return float(line.split()[1])


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_memory_back_and_wake_serves_the_same_tokens(server, level):
    expected = reference(MODEL, (PROMPTS[0],), 12)[0]
    assert server.complete(PROMPTS[0], 12, temperature=0) == expected
    asleep = server.http.post("/sleep", params={"level": level}, timeout=120)
    assert asleep.status_code == 200, asleep.text
    view = asleep.json()
    assert view["is_sleeping"] and view["level"] == level and set(view["ranks"]) == {"0", "1"}
    for rank, answer in view["ranks"].items():
        assert not answer["error"] and answer["rss_after_bytes"] < answer["rss_before_bytes"], (rank, answer)
    assert server.http.get("/is_sleeping").json()["is_sleeping"] is True
    assert sleep_state(server) == level
    assert server.http.get("/ready").status_code == 503
    refused = server.http.post("/v1/completions", json={"model": server.model, "prompt": PROMPTS[0], "max_tokens": 4})
    assert refused.status_code == 503 and refused.headers["retry-after"] and "asleep" in refused.text
    again = server.http.post("/sleep", params={"level": 1})
    assert again.status_code == 409 and "already asleep" in again.text
    woke = server.http.post("/wake_up", timeout=120)
    assert woke.status_code == 200 and woke.json()["is_sleeping"] is False, woke.text
    assert sleep_state(server) == 0 and server.http.get("/ready").status_code == 200
    assert server.complete(PROMPTS[0], 12, temperature=0) == expected
