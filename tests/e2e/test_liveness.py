"""The hang drill of seed 001's exercise 3 on a real 4-rank server whose fencing deadlines are
raised to minutes (as a large model needs): a SIGSTOPped rank is shown stalled, `/ready` turns
false with the reason and `/health` says degraded within seconds, long before any deadline
fences it; then the events of the fault reach the server's log as JSON lines."""

from __future__ import annotations

import json

import psutil
import pytest

from elastic_ep.harness.load import StreamingLoad

from .conftest import Server

RAISED_DEADLINES = ["--heartbeat-timeout-s", "300", "--watchdog-floor-s", "300", "--drain-timeout-s", "300",
                    "--restart-delay-s", "-1"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # 8 redundant experts: the 3 ranks left after the kill below still hold every expert
    s = Server(["--model", "tiny-deepseek-v3", "--ep-size", "4", "--redundant-experts", "8", "--enable-chaos",
                *RAISED_DEADLINES,
                "--log-format", "json", "--log-stats-interval-s", "1"],
               tmp_path_factory.mktemp("liveness") / "serve.log")
    try:
        s.wait_full_group(4)
        yield s
    finally:
        s.stop()


def rank(cluster: dict, rank_id: int) -> dict:
    return next(r for r in cluster["ranks"] if r["rank_id"] == rank_id)


def metric(server: Server, name: str) -> str:
    return next(line for line in server.http.get("/metrics").text.splitlines() if line.startswith(name))


def log_records(server: Server) -> list[dict]:
    """The server log's JSON lines (workers may print other lines: those are skipped)."""
    records = []
    for line in server.log().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


@pytest.mark.timeout(180)
@pytest.mark.e2e
def test_a_hung_rank_is_stalled_and_the_server_not_ready_within_seconds_then_logged(server):
    pid = server.pids()[1]
    with StreamingLoad(server.url, threads=3, max_tokens=32, prompts=["hello world"]) as load:
        start = server.cluster()["step"]
        server.wait_for(lambda c: c["step"] >= start + 10, 30, "10 steps")
        server.http.post("/chaos/hang", json={"rank_id": 1}).raise_for_status()
        try:
            stalled = server.wait_for(
                lambda c: not c["ready"] and (rank(c, 1)["liveness"] or {}).get("state") == "stalled", 10,
                "/cluster: not ready and rank 1 stalled")
            ready = server.http.get("/ready")
            health = server.http.get("/health")
            up = metric(server, 'elastic_ep_rank_up{rank="1"}')
        finally:
            server.http.post("/chaos/kill", json={"rank_id": 1}).raise_for_status()
        server.wait_for(lambda c: c["ready"] and 1 not in c["members"], 60, "recovered without rank 1")
        load.stop()
    assert not psutil.pid_exists(pid)
    assert stalled["epoch"] == 0 and rank(stalled, 1)["state"] == "serving"  # nothing fenced it: only seen
    assert "no heartbeat" in rank(stalled, 1)["liveness"]["reason"]
    assert {rank(stalled, r)["liveness"]["state"] for r in (0, 2, 3)} <= {"waiting", "live"}
    assert (ready.status_code == 503 and ready.json()["reason"].startswith("stalled:")
            and "rank 1" in ready.json()["reason"])
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert up == 'elastic_ep_rank_up{rank="1"} 0.0'
    assert stalled["deadlines"]["stall_deadline_s"] < 300 and stalled["deadlines"]["stall_multiple"] == 10.0
    assert load.failures == []

    events = [r for r in log_records(server) if r["logger"] == "elastic_ep.events"]
    seen = {(r["kind"], r["rank_id"]) for r in events}
    assert {("chaos", 1), ("stalled", None), ("fault", 1), ("fencing", 1), ("recovered", None)} <= seen
    assert any(r["kind"] == "epoch" and r["reason"] == "recovery" for r in events)
    fault = next(r for r in events if r["kind"] == "fault")
    assert fault["level"] == "WARNING" and "process killed by SIGKILL" in fault["message"]
    stats = [r for r in log_records(server) if r["logger"] == "elastic_ep.stats"]
    assert stats and {"running", "waiting", "epoch", "serving_ranks", "tokens_per_s"} <= set(stats[-1])

