"""`elastic-ep doctor` on a real 4-rank server: it names a SIGSTOPped rank as the one the
others wait for, and a rank slowed with `chaos slow` as the straggler. The server runs with
detection deadlines of minutes so the hang lasts while the doctor looks (the watchdog would
otherwise fence the rank within a second). Also: clear errors for a wrong URL."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from elastic_ep.cli import main
from elastic_ep.doctor.stacks import PY_SPY_MISSING, py_spy_path
from elastic_ep.harness.load import StreamingLoad
from elastic_ep.harness.server_process import ServerProcess, free_port

SLOW_DETECTION = ["--heartbeat-timeout-s", "300", "--watchdog-floor-s", "300", "--drain-timeout-s", "300",
                  "--restart-delay-s", "-1"]
# the rank both slow-rank tests slow: the stale-samples test runs right after the straggler test, so
# half of the slow rank's 256 recent own times in /cluster are slow ones already (fewer new slow steps)
SLOW = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the straggler policy off: these tests watch the doctor judge a slow rank the server leaves alone
    s = ServerProcess(["--model", "tiny-deepseek-v3", "--ep-size", "4", "--enable-chaos", "--straggler-policy", "off",
                       *SLOW_DETECTION],
                      tmp_path_factory.mktemp("doctor") / "serve.log")
    try:
        s.wait_full_group(4)
        yield s
    finally:
        s.stop()


def wait_steps(server: ServerProcess, count: int = 10, timeout_s: float = 30.0) -> None:
    start = server.cluster()["step"]
    server.wait_for(lambda c: c["step"] >= start + count, timeout_s, f"{count} steps")


def doctor(capsys, *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def verdicts(cluster: dict) -> dict[int, str]:
    return {r["rank_id"]: r["verdict"]["kind"] for r in cluster["ranks"] if r.get("verdict")}


def one_at_a_time(server: ServerProcess, stop: threading.Event) -> None:
    """A curl loop: one request at a time, so one rank holds all the work (DP imbalance)."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        while not stop.is_set():
            http.post("/v1/completions", json={"model": "tiny-deepseek-v3", "prompt": "hello world",
                                               "max_tokens": 32}).raise_for_status()


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_slow_rank_is_named_the_straggler_and_only_it(server, capsys):
    with StreamingLoad(server.url, threads=3, max_tokens=48, prompts=["hello world"]):
        wait_steps(server)
        server.http.post("/chaos/slow", json={"rank_id": SLOW, "delay_s": 0.05}).raise_for_status()
        try:
            named = server.wait_for(lambda c: "straggler" in verdicts(c).values(), 30, "a straggler verdict")
            code, out = doctor(capsys, server.url, "--json", "--interval-s", "4")
        finally:
            server.http.post("/chaos/slow", json={"rank_id": SLOW, "delay_s": 0.0}).raise_for_status()
    report = json.loads(out)
    assert [r for r, kind in verdicts(named).items() if kind == "straggler"] == [SLOW]
    assert code == 0, report["findings"]
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    assert [r["rank_id"] for f in stragglers for r in f["ranks"]] == [SLOW], report["verdicts"]
    assert stragglers[0]["ranks"][0]["pid"] == server.pids()[SLOW]
    assert "slow, not bad" in stragglers[0]["suspicion"]
    assert stragglers[0]["evidence"]["steps"] >= 10 and "intervals spanning" in stragglers[0]["symptom"]
    assert not [f for f in report["findings"] if f["kind"] in ("hang", "path", "process")]


@pytest.mark.timeout(180)
@pytest.mark.e2e
def test_idle_cluster_with_stale_slow_samples_names_no_straggler(server, capsys):
    def stale_p50s_accuse_the_slow_rank(c: dict, times: float = 2.0) -> bool:
        own = {r["rank_id"]: (r["own_ms"] or {"p50": 0.0})["p50"] for r in c["ranks"]}
        return own[SLOW] > times * max(v for r, v in own.items() if r != SLOW) + 2

    server.http.post("/chaos/slow", json={"rank_id": SLOW, "delay_s": 0.1}).raise_for_status()
    try:  # until most of /cluster's recent steps of rank 2 are slow ones; then the load stops, slow to the end
        with StreamingLoad(server.url, threads=3, max_tokens=48, prompts=["hello world"]):
            # a margin over the 2x checked below: the requests in flight end with a few more steps
            server.wait_for(lambda c: stale_p50s_accuse_the_slow_rank(c, 3.0), 90, "rank 2's recent own time p50 high")
    finally:
        server.http.post("/chaos/slow", json={"rank_id": SLOW, "delay_s": 0.0}).raise_for_status()
    # idle now: the slow steps stay in /cluster's recent percentiles but age out of the verdict
    idle = server.wait_for(lambda c: set(verdicts(c).values()) == {"unknown"}, 30, "no verdict once idle")
    code, out = doctor(capsys, server.url, "--json")
    report = json.loads(out)
    assert stale_p50s_accuse_the_slow_rank(idle)
    assert code == 0 and not [f for f in report["findings"] if f["kind"] == "straggler"], report["findings"]
    assert "kill -9" not in out
    # too few fresh steps to judge anyone: every verdict says so, none accuses
    assert {v["kind"] for v in report["verdicts"].values()} == {"unknown"}, report["verdicts"]


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_one_request_at_a_time_is_dp_imbalance_not_a_straggler(server, capsys):
    stop = threading.Event()
    loop = threading.Thread(target=one_at_a_time, args=(server, stop))
    loop.start()
    try:
        judged = server.wait_for(lambda c: "dp-imbalance" in verdicts(c).values(), 30, "a dp-imbalance verdict")
        code, out = doctor(capsys, server.url, "--json", "--interval-s", "4")
    finally:
        stop.set()
        loop.join(60)
    report = json.loads(out)
    assert "straggler" not in verdicts(judged).values()
    heavy = [r for r, kind in verdicts(judged).items() if kind == "dp-imbalance"]
    assert len(heavy) == 1
    assert code == 0 and not [f for f in report["findings"] if f["kind"] == "straggler"], report["findings"]
    assert [r["rank_id"] for f in report["findings"] if f["kind"] == "dp-imbalance" for r in f["ranks"]] == heavy, \
        report["verdicts"]
    assert not any("kill -9" in f["action"] for f in report["findings"])


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_stopped_rank_is_named_as_the_one_the_others_wait_for(server, capsys):
    pid = server.pids()[1]
    with StreamingLoad(server.url, threads=3, max_tokens=48, prompts=["hello world"]):
        wait_steps(server)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.5)
            code, out = doctor(capsys, server.url, "--py-spy", "--interval-s", "1.0")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_steps(server, 5)  # the rank goes on: the doctor only looked, nothing fenced it
    assert code == 1
    hang = out.split("[CRITICAL] hang:")[1].split("\n\n")[0]
    assert f"ranks:     rank 1 (node0, pid {pid})\n" in hang
    assert "[CRITICAL] process: process state of rank(s) 1: stopped" in out
    if py_spy_path() is None:
        assert PY_SPY_MISSING in out
    else:
        dump = out.split("--- py-spy dump of rank 1 ---")[1]
        assert "worker.py" in dump.split("--- py-spy dump")[0]
    cluster = server.cluster()
    assert cluster["epoch"] == 0, [e["message"] for e in cluster["events"][-12:]]


@pytest.mark.timeout(60)
@pytest.mark.e2e
def test_watch_diagnoses_again_until_interrupted(server):
    # SIGINT at its default in the child: a suite started in the background (`pytest &` from a script)
    # hands its children SIGINT ignored, and Python then keeps it ignored, so the interrupt never came
    proc = subprocess.Popen([sys.executable, "-m", "elastic_ep.cli", "doctor", server.url, "--json",
                             "--watch", "0.2", "--interval-s", "0.2"], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        reports = [json.loads(proc.stdout.readline()) for _ in range(2)]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert [r["url"] for r in reports] == [server.url] * 2 and all(r["ready"] for r in reports)


def test_unreachable_url_is_a_clear_error(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["doctor", url]) == 2
    assert f"cannot reach {url}" in capsys.readouterr().err


def test_a_server_that_is_not_elastic_ep_is_named_so(capsys):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        assert main(["doctor", f"http://127.0.0.1:{httpd.server_address[1]}"]) == 2
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "not an elastic-ep server" in capsys.readouterr().err
