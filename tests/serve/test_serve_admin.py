"""Operator routes: health, readiness, metrics, cluster, dashboard, scaling, recorder, chaos."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scripted_engine import MODEL, SLOW_RANK, sample_cluster

from elastic_ep.cli import main
from elastic_ep.control.api import Health, Readiness
from elastic_ep.harness.browser import dump_dom
from elastic_ep.serve.admin import DASHBOARD_HTML
from elastic_ep.serve.metrics import FINISHED_REASONS


def metric_samples(served) -> dict:
    """{(sample name, frozenset(labels)): value} from GET /metrics."""
    response = httpx.get(f"{served.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_health_and_readiness(served):
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok", "reason": ""}
    assert httpx.get(f"{served.url}/ready").json() == {"ready": True, "reason": ""}
    served.engine.ready = Readiness(False, "loading dense weights on rank 1")
    served.engine.healthy = Health("degraded", "not ready: loading dense weights on rank 1")
    try:
        response = httpx.get(f"{served.url}/ready")
        assert response.status_code == 503
        assert response.json()["reason"] == "loading dense weights on rank 1"
        health = httpx.get(f"{served.url}/health")  # alive: a liveness probe must not restart it
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        served.engine.healthy = Health("dead", "the control loop stopped: boom")
        health = httpx.get(f"{served.url}/health")
        assert health.status_code == 503 and health.json() == {
            "status": "dead", "reason": "the control loop stopped: boom"}
    finally:
        served.engine.ready = Readiness(True)
        served.engine.healthy = Health("ok")


def test_metrics_count_requests_tokens_and_latency(served):
    before = metric_samples(served)
    ok = ("elastic_ep_http_requests_total", frozenset({("endpoint", "/v1/completions"), ("status", "200")}))
    bad = ("elastic_ep_http_requests_total", frozenset({("endpoint", "/v1/completions"), ("status", "400")}))
    model = frozenset({("model_name", MODEL)})
    for reason in FINISHED_REASONS:  # a zero sample before the first event: increase() sees the first one
        assert ("elastic_ep_request_success_total", model | {("finished_reason", reason)}) in before
    for _ in range(3):
        httpx.post(f"{served.url}/v1/completions", json={"prompt": "abcd", "max_tokens": 6})
    httpx.post(f"{served.url}/v1/completions", json={"prompt": "abcd", "max_tokens": 0})
    after = metric_samples(served)

    def grew(name, labels=model):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew(*ok) == 3
    assert grew(*bad) == 1
    assert grew("elastic_ep_prompt_tokens_total") == 12
    assert grew("elastic_ep_generation_tokens_total") == 18
    assert grew("elastic_ep_time_to_first_token_seconds_count") == 3
    assert grew("elastic_ep_time_per_output_token_seconds_count") == 3
    assert grew("elastic_ep_e2e_request_latency_seconds_count") == 3
    assert grew("elastic_ep_e2e_request_latency_seconds_sum") > 0
    assert grew("elastic_ep_request_success_total", model | {("finished_reason", "length")}) == 3
    assert after[("elastic_ep_http_requests_running", model)] == 0
    assert not [name for name, _ in after if name.endswith("_created")]


def test_cluster_and_dashboard(served):
    cluster = httpx.get(f"{served.url}/cluster").json()
    assert cluster["epoch"] == 3
    assert {"rank_id", "node", "pid", "state", "step_ms"} <= set(cluster["ranks"][0])
    page = httpx.get(f"{served.url}/", follow_redirects=True)
    assert page.url.path == "/dashboard"
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "/cluster" in page.text and "/is_scaling_elastic_ep" in page.text
    assert "http://" not in page.text and "https://" not in page.text, "the dashboard must work offline"


def test_dashboard_in_chromium_shows_the_straggler_first_and_in_the_header(served, chromium):
    dom = dump_dom(f"{served.url}/dashboard", chromium)
    radar = dom[dom.index('id="radar"') :]
    first_row = radar[: radar.index("</tr>")]
    assert f"<td>{SLOW_RANK}</td>" in first_row
    assert 'class="worst"' in first_row and "4.17×" in first_row  # the verdict's ratio, not a second one
    assert radar.count('class="worst"') == 1
    assert "epoch" in dom and ">3<" in dom
    assert f'id="slow">rank {SLOW_RANK} (4.2×)<' in dom and 'id="health">degraded<' in dom
    ranks = dom[dom.index('id="ranks"') : dom.index("</tbody>", dom.index('id="ranks"'))]
    slow_row = next(row for row in ranks.split("</tr>") if f"<td>{SLOW_RANK}</td>" in row)
    assert 'class="worst"' in slow_row and ">straggler 4.17×<" in slow_row


def test_dashboard_in_chromium_shows_deadlines_in_their_units_scale_and_load(served, chromium):
    dom = dump_dom(f"{served.url}/dashboard", chromium)
    assert "<dt>exit_poll_interval_s</dt><dd>0.005 s</dd>" in dom  # not rounded to 0.01
    assert "<dt>stall_multiple</dt><dd>10× the median step</dd>" in dom  # a multiplier, not seconds
    assert "<dt>heartbeat_timeout_s</dt><dd>2 s</dd>" in dom
    assert "<dt>phase</dt><dd><b>serving</b></dd>" in dom and "<dt>ranks serving</dt><dd>4</dd>" in dom
    scale_panel = dom[dom.index('id="scale"') : dom.index("</dl>", dom.index('id="scale"'))]
    assert "is_scaling" not in scale_panel and "{" not in scale_panel, "fields by name, not raw JSON"
    assert '<b id="tokens-per-s">240.0</b>' in dom and '<b id="waiting">3</b>' in dom
    assert "<dt>requests waiting</dt><dd>3</dd>" in dom and "<dt>tokens run</dt><dd>250.0 /s</dd>" in dom
    served.engine.scaling_to = 6
    try:
        scaling = dump_dom(f"{served.url}/dashboard", chromium)
    finally:
        served.engine.scaling_to = None
    assert "<dd><b>joining</b> (scaling)</dd>" in scaling and "<dt>scale</dt><dd>4 → 6 ranks</dd>" in scaling


# Runs the dashboard's script on a /cluster document with stub DOM and fetch; prints what it rendered.
DASHBOARD_IN_NODE = """
const fs = require("fs");
const html = fs.readFileSync(process.argv[1], "utf8");
const cluster = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const els = {};
global.document = { getElementById: (id) => (els[id] ??= \
{ innerHTML: "", textContent: "", style: {}, className: "" }) };
global.fetch = async (p) => ({ ok: true, json: async () => (p === "/cluster" ? cluster : { state: "idle" }) });
global.setTimeout = () => {};
eval(html.slice(html.indexOf("<script>") + 8, html.lastIndexOf("</script>")));
setImmediate(() => setImmediate(() => console.log(JSON.stringify(
  Object.fromEntries(Object.entries(els).map(([k, v]) => [k, v.innerHTML || v.textContent || v.className]))))));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the dashboard's script")
def test_dashboard_shows_a_stalled_rank_readiness_and_the_servers_verdict(tmp_path):
    cluster = sample_cluster(4)
    cluster["ranks"][1]["liveness"] = {"state": "stalled", "stalled_s": 3.2, "reason": "no heartbeat for 3.2s"}
    cluster.update(ready=False, reason="stalled: the step in flight has run 3.2s",
                   health={"status": "degraded", "reason": "not ready"})
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    out = subprocess.run(["node", "-e", DASHBOARD_IN_NODE, str(DASHBOARD_HTML), str(tmp_path / "cluster.json")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    shown = json.loads(out)
    stalled_row = shown["ranks"].split("</tr>")[1]
    assert '<span class="state stalled" title="no heartbeat for 3.2s">stalled</span>' in stalled_row
    assert shown["ready"] == "no" and "stalled: the step in flight has run 3.2s" in shown["reason"]
    assert shown["health"] == "degraded" and shown["live"] == 3
    radar_rows = shown["radar"].split("</tr>")[:-1]
    assert [row.startswith('<tr class="worst">') for row in radar_rows] == [True, False, False, False]
    assert f"<td>{SLOW_RANK}</td>" in radar_rows[0] and "<b>straggler</b>" in radar_rows[0]


def test_scale_maps_engine_answers_to_status_codes(served):
    url = f"{served.url}/scale_elastic_ep"
    assert httpx.post(url, content=b'{"new_ep_size": "six"}').status_code == 400
    assert httpx.post(url, json={}).json()["error"]["param"] == "new_ep_size"
    assert httpx.post(url, json={"new_ep_size": 0}).status_code == 400
    too_big = httpx.post(url, json={"new_ep_size": 9})
    assert too_big.status_code == 400
    assert "--max-ep-size 8" in too_big.json()["error"]["message"]
    try:
        started = httpx.post(url, json={"new_ep_size": 6})
        assert started.status_code == 200
        assert started.json() == {"old_ep_size": 4, "new_ep_size": 6}
        assert httpx.get(f"{served.url}/is_scaling_elastic_ep").json()["is_scaling"] is True
        busy = httpx.post(url, json={"new_ep_size": 8})
        assert busy.status_code == 409
        assert "in progress" in busy.json()["error"]["message"]
    finally:
        served.engine.scaling_to = None


def test_rolling_restart_takes_the_worker_options_and_refuses_the_rest(served, tmp_path, monkeypatch):
    url = f"{served.url}/rolling_restart"
    for body, param in [({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
                        ({"num_gpu_blocks_override": -1}, "num_gpu_blocks_override"),
                        ({"max_num_seqs": 4}, "max_num_seqs"), ({"model": ""}, "model")]:
        refused = httpx.post(url, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (body, refused.text)
    monkeypatch.chdir(tmp_path)
    try:
        started = httpx.post(url, json={"model": "moved", "kv_cache_memory": 1 << 20})
        assert started.status_code == 200, started.text
        assert served.engine.rollouts[-1] == {"model_dir": str(tmp_path / "moved"), "kv_cache_memory": 1 << 20}
        assert httpx.get(url).json()["state"] == "running"
        again = httpx.post(url)  # no body: the same options
        assert again.status_code == 409 and "/rolling_restart/abort" in again.json()["error"]["message"]
        assert httpx.post(f"{url}/abort").json()["state"] == "aborted"
        assert httpx.post(f"{url}/abort").status_code == 409
        assert httpx.post(url).status_code == 200 and served.engine.rollouts[-1] == {}
    finally:
        served.engine.rollouts = []


def test_the_rollout_command_starts_follows_and_aborts(served, capsys):
    try:
        assert main(["rollout", served.url, "--num-gpu-blocks-override", "64", "--no-wait"]) == 0
        assert served.engine.rollouts[-1] == {"num_gpu_blocks_override": 64}
        assert "rolling restart of 4 processes with {'num_gpu_blocks_override': 64}" in capsys.readouterr().out
        assert main(["rollout", served.url]) == 2  # one is in flight: refused with the server's reason
        assert "refused (HTTP 409): a rolling restart is in flight" in capsys.readouterr().err
        assert main(["rollout", served.url, "--abort", "--model", "x"]) == 2
        assert "--abort takes no options" in capsys.readouterr().err
        assert main(["rollout", served.url, "--abort"]) == 0
        out = capsys.readouterr().out
        assert "aborting: no rank in flight" in out and "rolling restart aborted" in out
        assert "not replaced: ranks [0, 1, 2, 3]" in out
    finally:
        served.engine.rollouts = []


def test_expert_distribution_recorder(served):
    assert httpx.post(f"{served.url}/start_expert_distribution_record").status_code == 200
    assert served.engine.recording
    assert httpx.post(f"{served.url}/stop_expert_distribution_record").status_code == 200
    assert not served.engine.recording
    dump = httpx.post(f"{served.url}/dump_expert_distribution_record").json()
    assert (dump["layers"], dump["experts"]) == (2, 8)


def test_chaos_is_refused_unless_enabled(served, capsys):
    response = httpx.post(f"{served.url}/chaos/kill", json={"rank_id": 1})
    assert response.status_code == 404
    assert "--enable-chaos" in response.json()["error"]["message"]
    assert main(["chaos", served.url, "kill", "1"]) == 2
    assert "--enable-chaos" in capsys.readouterr().err
    assert served.engine.chaos_calls == []


@pytest.mark.parametrize(("action", "delay_s"), [("kill", 0.0), ("slow", 0.25), ("hang", 0.0)])
def test_chaos_cli_reaches_the_engine(served_chaos, capsys, action, delay_s):
    assert main(["chaos", served_chaos.url, action, "2", "--delay-s", str(delay_s)]) == 0
    assert served_chaos.engine.chaos_calls[-1] == (action, 2, delay_s)
    assert f'"action": "{action}"' in capsys.readouterr().out


def test_chaos_rejects_bad_input(served_chaos):
    assert httpx.post(f"{served_chaos.url}/chaos/explode", json={"rank_id": 1}).status_code == 404
    assert httpx.post(f"{served_chaos.url}/chaos/kill", json={}).status_code == 400
    assert httpx.post(f"{served_chaos.url}/chaos/slow", json={"rank_id": 1, "delay_s": -1}).status_code == 400


def test_chaos_cli_names_an_unreachable_server(capsys):
    assert main(["chaos", "http://127.0.0.1:9", "kill", "0", "--timeout-s", "2"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_drain_and_uncordon_map_engine_answers_to_status_codes(served):
    try:
        drained = httpx.post(f"{served.url}/drain", json={"ranks": [1]})
        assert drained.status_code == 200
        assert drained.json() == {"ranks": [1], "node": None, "old_ep_size": 4, "new_ep_size": 3}
        both = httpx.post(f"{served.url}/drain", json={"ranks": [1], "node": "n0"})
        assert both.status_code == 400 and "not both" in both.json()["error"]["message"]
        unknown = httpx.post(f"{served.url}/drain", json={"node": "n9"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "node"
        assert httpx.post(f"{served.url}/drain", json={"ranks": [-1]}).status_code == 400
        assert httpx.post(f"{served.url}/drain", json={"node": "n0"}).json()["new_ep_size"] == 0
        not_cordoned = httpx.post(f"{served.url}/uncordon", json={"node": "n1"})
        assert not_cordoned.status_code == 400 and "not cordoned" in not_cordoned.json()["error"]["message"]
        assert httpx.post(f"{served.url}/uncordon", json={"node": "n0"}).json() == {"node": "n0", "cordoned": False}
        assert httpx.post(f"{served.url}/uncordon", json={}).json()["error"]["param"] == "node"
    finally:
        served.engine.cordoned = None


def test_sleep_and_wake_use_vllms_paths(served):
    try:
        assert httpx.post(f"{served.url}/sleep", params={"level": 3}).status_code == 400
        assert httpx.post(f"{served.url}/sleep", params={"level": 2}).json()["is_sleeping"] is True
        assert httpx.get(f"{served.url}/is_sleeping").json() == {"is_sleeping": True, "level": 2}
        assert httpx.post(f"{served.url}/wake_up").json()["is_sleeping"] is False
    finally:
        served.engine.sleep_level = 0
