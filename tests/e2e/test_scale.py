"""Online scaling end to end: one real server for the module, streaming requests running the
whole time (a load loop), scales and `kill -9`s in between. No request fails, every output
equals the fault-free run, /is_scaling_elastic_ep walks through its phases.

The tests share one server; each first brings it to the size it starts from (`at_size`), so
none depends on where another left it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import PROMPTS, rank_process, reference_load

MODEL = "tiny-deepseek-v3"
# 16 experts + 16 redundant over 4 ranks: 8 slots per rank, so 2 ranks hold every expert.
# No readiness gate: these ~30 epochs would each run its 9 warm-up forwards first (about 20 s of
# the module); the gate is proven in test_cold_start.py and, across rebalances, in test_serve.py.
SERVE_ARGS = ("--model", MODEL, "--ep-size", "4", "--redundant-experts", "16", "--max-ep-size", "6",
              "--restart-delay-s", "0.5", "--scale-drain-timeout-s", "1.0", "--no-warmup-gate")


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(*SERVE_ARGS)


def scale(server, n: int) -> dict:
    reply = server.http.post("/scale_elastic_ep", json={"new_ep_size": n})
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_scaled(server, n: int, phase: str, timeout_s: float = 90.0) -> dict:
    """Wait for the scale to end in `phase` with `n` ranks serving; returns the status."""
    deadline = time.monotonic() + timeout_s
    phases = []
    while time.monotonic() < deadline:
        status = server.http.get("/is_scaling_elastic_ep").json()
        phases.append(status["scale_phase"])
        if not status["is_scaling_elastic_ep"]:
            assert status["scale_phase"] == phase, status
            server.wait_full_group(n)
            status["seen"] = set(phases)
            return status
        time.sleep(0.05)
    raise TimeoutError(f"scale to {n} not done in {timeout_s}s: {phases[-5:]}")


def at_size(server, n: int) -> None:
    """Bring the server to `n` serving ranks (a scale, if it has another size)."""
    if server.wait_full_group(server.cluster()["ep_size"])["ep_size"] != n:
        scale(server, n)
        wait_scaled(server, n, "serving_expanded" if n > server.cluster()["scale"]["old_ep_size"] else "serving_shrunk")


def kill_rank(server, rank_id: int, n: int) -> None:
    """kill -9 a rank, wait until it is back and the group has `n` ranks again."""
    before = server.cluster()["epoch"]
    os.kill(server.pids()[rank_id], signal.SIGKILL)
    server.wait_for(lambda c: c["epoch"] > before and c["ready"], what="a recovery")
    server.wait_full_group(n)


def test_invalid_and_concurrent_scale_requests_are_400_and_409(server):
    at_size(server, 4)
    for body, needle in [({"new_ep_size": 1}, "2..6"), ({"new_ep_size": 7}, "--max-ep-size 6"),
                         ({"new_ep_size": 4}, "already has 4"), ({"new_ep_size": 0}, "greater than or equal to 1"),
                         ({"size": 5}, "new_ep_size")]:
        reply = server.http.post("/scale_elastic_ep", json=body)
        assert reply.status_code == 400 and needle in reply.text, (body, reply.text)
    assert scale(server, 5) == {"old_ep_size": 4, "new_ep_size": 5}
    busy = server.http.post("/scale_elastic_ep", json={"new_ep_size": 6})
    assert busy.status_code == 409 and "in flight" in busy.text
    wait_scaled(server, 5, "serving_expanded")
    assert scale(server, 4) == {"old_ep_size": 5, "new_ep_size": 4}
    wait_scaled(server, 4, "serving_shrunk")
    server.complete(PROMPTS[0], 4)
    cluster = server.wait_for(lambda c: all(r["own_ms"] for r in c["ranks"]), what="own time of every rank")
    assert abs(cluster["time_s"] - time.time()) < 5
    for rank in cluster["ranks"]:
        assert rank["ready"] and rank["own_ms"]["p50"] > 0 and 0 <= rank["heartbeat_age_s"] < 1.0


def test_4_6_3_5_with_a_kill_between_steps_under_load(server):
    at_size(server, 4)
    # 6 streams: one per rank at 6 ranks, so the ranks that leave have requests to drain
    with reference_load(server, MODEL, threads=6) as load:
        scale(server, 6)
        up = wait_scaled(server, 6, "serving_expanded")
        assert {"joining", "configuring_data_plane"} & up["seen"] and up["new_ranks"] == [4, 5]
        kill_rank(server, 5, 6)
        scale(server, 3)
        down = wait_scaled(server, 3, "serving_shrunk")
        assert down["retiring"] == [3, 4, 5]
        cluster = server.cluster()
        assert sorted(r["rank_id"] for r in cluster["ranks"]) == [0, 1, 2]
        for step in ("draining ranks [3, 4, 5]", "ranks [3, 4, 5] drained in", "moving experts off ranks [3, 4, 5]",
                     "stopped (exited with code 0)"):
            assert any(step in e["message"] for e in cluster["events"]), step
        kill_rank(server, 0, 3)
        scale(server, 5)
        wait_scaled(server, 5, "serving_expanded")
        kill_rank(server, 4, 5)
        load.wait_done(load.done + 3)
    assert not load.failures, load.failures[:3]


def test_three_recover_cycles_of_the_same_rank_under_load(server):
    at_size(server, 5)
    last = server.cluster()["events"][-1]["id"]
    with reference_load(server, MODEL, threads=2) as load:
        for _ in range(3):
            kill_rank(server, 2, 5)
    assert not load.failures, load.failures[:3]
    events = server.http.get("/cluster", params={"since": last, "events": 0}).json()["events"]
    recovered = [e for e in events if e["kind"] == "recovered" and 2 in e["culprits"]]
    assert len(recovered) >= 3
    # read once, copy many: a restarted rank maps its node agent's copy of the dense weights
    rejoined = [e for e in events if e["kind"] == "registered" and e["rank_id"] == 2]
    assert rejoined and all("(recover)" in e["message"] and e["dense_source"] == "host_memory" for e in rejoined)


def test_a_joiner_killed_mid_join_fails_that_scale_not_the_service(server):
    at_size(server, 5)
    with reference_load(server, MODEL, threads=2) as load:
        scale(server, 6)
        # as soon as its process exists: forked from the zygote, it joins within a second
        os.kill(rank_process(server, 5), signal.SIGKILL)
        status = wait_scaled(server, 5, "failed")
        assert "joining rank 5" in status["last_error"] and status["effective_ep_size"] == 5
        server.wait_for(lambda c: 5 not in {r["rank_id"] for r in c["ranks"]}, what="rank 5 gone")
    assert not load.failures, load.failures[:3]
    assert load.done > 0
