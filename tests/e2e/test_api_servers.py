"""`serve --api-server-count 2`: two API server processes in front of the controller's.

Greedy completions and streams equal single-process `elastic-ep generate`, served by both
processes; a rank killed mid-stream fails no stream and changes no output; every other route
(/cluster, /metrics, chaos) answers through either server; a hostile frame on the ipc sockets
between the processes is dropped and counted, runs no code and changes nothing; bad input is a
4xx; a client that leaves mid-stream frees its request; stopping `serve` leaves no process, and
an API server killed stops `serve` with a message naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.commands.api_server import ApiServerLaunch
from elastic_ep.harness.server_process import processes_left
from elastic_ep.harness.wire_fuzz import JUNK, evil_pickle
from elastic_ep.serve.proxy import SERVED_BY_HEADER
from elastic_ep.wire.api_server import api_address, tokens_address

from .conftest import PROMPTS, Server, concurrently, leave_mid_stream, reference, reference_load

pytestmark = pytest.mark.e2e

MODEL = "tiny-deepseek-v3"
MAX_TOKENS = 16
PATIENT = ("--heartbeat-timeout-s", "3", "--agent-timeout-s", "3", "--lease-s", "15")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    server = Server(["--model", MODEL, "--ep-size", "2", "--api-server-count", "2", "--max-model-len", "256",
                     "--enable-chaos", *PATIENT], tmp_path_factory.mktemp("api-servers") / "serve.log",
                    ready_timeout_s=300)
    yield server
    server.stop()


def launches(server: Server) -> list[tuple[int, ApiServerLaunch]]:
    """(pid, launch) of each API server process, from their command lines."""
    found = []
    for child in psutil.Process(server.proc.pid).children():
        cmd = child.cmdline()
        if "elastic_ep.commands.api_server" in cmd:
            found.append((child.pid, msgspec.json.decode(cmd[-1], type=ApiServerLaunch)))
    return sorted(found, key=lambda f: f[1].server)


def complete(server: Server, prompt: str) -> tuple[str, str]:
    """(the API server that answered, the text), on a connection of its own (a kept-alive one
    stays with one server)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.headers[SERVED_BY_HEADER], r.json()["choices"][0]["text"]


def rejected(server: Server) -> dict[tuple[str, str], float]:
    """(socket, node) -> frames dropped, from /metrics."""
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name == "elastic_ep_control_frames_rejected_total":
                key = (s.labels["socket"], s.labels["node"])
                counts[key] = counts.get(key, 0) + s.value
    return counts


def test_outputs_equal_generate_and_both_processes_serve(two):
    assert [launch.server for _, launch in launches(two)] == [0, 1]
    expected = list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))
    served_by: set[str] = set()
    for _ in range(10):  # which process accepts a connection is the kernel's choice
        answers = concurrently(lambda p: complete(two, p), PROMPTS)
        assert [text for _, text in answers] == expected
        served_by |= {by for by, _ in answers}
        if served_by == {"0", "1"}:
            break
    assert served_by == {"0", "1"}
    streamed = concurrently(lambda p: two.stream(p, MAX_TOKENS, temperature=0), PROMPTS[:4])
    assert streamed == expected[:4]


def test_other_routes_answer_through_the_servers_and_metrics_sum_them(two):
    cluster = two.cluster()  # the controller's app, through whichever server took the connection
    assert [r["rank_id"] for r in cluster["ranks"]] == [0, 1]
    for _ in range(4):
        complete(two, PROMPTS[0])
    text = httpx.get(f"{two.url}/metrics").text
    assert text.count("# TYPE elastic_ep_http_requests_total counter") == 1  # one family, summed over the servers
    families = {f.name: f for f in text_string_to_metric_families(text)}
    by_endpoint = {}
    for s in families["elastic_ep_http_requests"].samples:
        if s.labels["status"] == "200":
            by_endpoint[s.labels["endpoint"]] = by_endpoint.get(s.labels["endpoint"], 0) + s.value
    assert by_endpoint["/v1/completions"] >= 4
    assert by_endpoint["/cluster"] >= 1  # forwarded requests counted by the route that answered them
    assert "/{path:path}" not in by_endpoint
    assert families["elastic_ep_epoch"].samples[0].value >= 0  # the controller's own metrics beside them
    assert "elastic_ep_http_requests_running" in families
    schema = httpx.get(f"{two.url}/openapi.json").json()  # forwarded: the whole API's document
    assert {"/v1/completions", "/v1/chat/completions", "/cluster", "/scale_elastic_ep"} <= set(schema["paths"])
    assert httpx.get(f"{two.url}/docs").status_code == 200


def test_bad_input_is_a_4xx_and_the_servers_keep_serving(two):
    bad = [
        ("malformed JSON", b"{not json"),
        ("unknown model", json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()),
        ("prompt over --max-model-len", json.dumps({"model": MODEL, "prompt": "word " * 400}).encode()),
        ("n = 0", json.dumps({"model": MODEL, "prompt": "hi", "n": 0}).encode()),
    ]
    for what, body in bad:
        for _ in range(2):  # new connections: each server's answer
            r = httpx.post(f"{two.url}/v1/completions", content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
            assert "message" in r.json()["error"], what
    r = httpx.post(f"{two.url}/chaos/kill", json={"rank_id": 99})  # forwarded, refused by the controller's app
    assert 400 <= r.status_code < 500, r.text
    assert complete(two, PROMPTS[0])[1] == reference(MODEL, tuple(PROMPTS), MAX_TOKENS)[0]


def test_a_client_leaving_mid_stream_frees_its_request(two):
    for _ in range(2):  # new connections: likely both servers
        leave_mid_stream(two, PROMPTS[1])
    two.wait_for(lambda c: sum(rank["requests"] for rank in c["ranks"]) == 0, timeout_s=10,
                 what="the aborted requests freed")


def test_hostile_frames_between_the_processes_are_dropped_and_counted(two, tmp_path):
    workdir = Path(launches(two)[0][1].workdir)
    before = rejected(two)
    marker = tmp_path / "code-ran"
    ctx = zmq.Context.instance()
    with reference_load(two, MODEL, threads=2, max_tokens=MAX_TOKENS) as load:
        load.wait_done(2)
        for addr, kind in ((api_address(workdir), zmq.DEALER), (tokens_address(workdir, 0), zmq.PUSH),
                           (tokens_address(workdir, 1), zmq.PUSH)):
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            for frame in (JUNK, evil_pickle(str(marker))):
                sock.send(frame)
                sock.send_multipart([b"", frame])
            sock.close()
        done = load.done
        load.wait_done(done + 4)
    assert load.failures == []
    assert not marker.exists()

    def counted() -> bool:
        after = rejected(two)
        grew = {key for key, n in after.items() if n > before.get(key, 0)}
        return {s for s, _ in grew} >= {"api_servers", "api_tokens"} and {
            node for s, node in grew if s == "api_tokens"} == {"api-server-0", "api-server-1"}

    two.wait_for(lambda _: counted(), timeout_s=10, what="the dropped frames counted")
    assert all(psutil.Process(pid).is_running() for pid, _ in launches(two))


def test_a_rank_killed_mid_stream_fails_no_stream(two):
    victim = next(r for r in two.cluster()["ranks"] if r["rank_id"] == 1)
    epoch = two.cluster()["epoch"]
    with reference_load(two, MODEL, threads=3, max_tokens=MAX_TOKENS) as load:
        load.wait_done(3)
        two.http.post("/chaos/kill", json={"rank_id": 1}).raise_for_status()
        two.wait_for(lambda c: c["epoch"] > epoch and c["ready"], timeout_s=120, what="recovery from the kill")
        done = load.done
        load.wait_done(done + 6)
    assert load.failures == []
    assert not psutil.pid_exists(victim["pid"]) or psutil.Process(victim["pid"]).status() == psutil.STATUS_ZOMBIE


def test_stopping_serve_ends_every_api_server(two):
    pids = {pid for pid, _ in launches(two)}
    workdir = Path(launches(two)[0][1].workdir)
    assert len(pids) == 2
    two.stop()
    assert processes_left(pids) == []
    assert not workdir.exists()


def test_an_api_server_killed_stops_serve_and_leaves_no_process(tmp_path):
    server = Server(["--model", MODEL, "--ep-size", "1", "--api-server-count", "2", "--max-model-len", "256"],
                    tmp_path / "serve.log", ready_timeout_s=300)
    try:
        pids = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
        (victim, launch), _ = launches(server)
        psutil.Process(victim).kill()
        code = server.proc.wait(60)
        assert processes_left(pids) == []
        assert not Path(launch.workdir).exists()
    finally:
        server.stop()
    assert code == 2
    assert f"error: stopped: API server 0 (pid {victim}) killed by signal 9" in server.log_path.read_text()


def test_api_server_count_below_one_is_refused_with_a_message():
    r = subprocess.run([sys.executable, "-m", "elastic_ep.cli", "serve", "--model", MODEL, "--api-server-count", "0",
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--api-server-count must be >= 1" in r.stderr and "Traceback" not in r.stderr
