"""The operator assets in deploy/: the alert rules pass promtool's check and unit tests, every
rule and dashboard expression is valid PromQL over metrics the server exports, and the Kubernetes
manifests are valid against Kubernetes' own schemas (offline) and wire what the runbook says."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from elastic_ep.cli import command_parser
from elastic_ep.control.events import EventLog
from elastic_ep.control.membership.hardware import HardwareSignals
from elastic_ep.control.metrics import ClusterMetrics
from elastic_ep.harness.server_process import free_port
from elastic_ep.serve.metrics import HttpMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = Path(__file__).parent / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "elastic-ep.json"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# Grafana's variables, given values so that promtool can parse the dashboard's expressions
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$model_name": ".*"}


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: run scripts/install-netbed-deps.sh (installs Debian's prometheus package)")
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def exported_names() -> set[str]:
    """Every sample name the server's metric families export (counters as _total, histograms as
    _bucket / _sum / _count)."""
    registry = CollectorRegistry()
    ClusterMetrics(registry, "model", 16)
    HttpMetrics(registry, "model")
    HardwareSignals(registry, EventLog())
    names = set()
    for family in registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "summary": ["_sum", "_count"]}.get(family.type, [""])
        names |= {family.name + s for s in suffixes}
    return names


def dashboard_exprs() -> list[str]:
    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                yield node["expr"]
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    return list(walk(json.loads(DASHBOARD.read_text())))


def rule_exprs() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\belastic_ep_[a-z0-9_]+", expr))


def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    check = promtool("check", "rules", str(RULES))
    assert check.returncode == 0, check.stdout + check.stderr
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    assert alerts <= set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text())), "every alert has a unit test"


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_expression_reads_metrics_the_server_exports(source):
    exprs = rule_exprs() if source == "rules" else dashboard_exprs()
    used = set().union(*(metric_names(e) for e in exprs))
    assert used, source
    missing = used - exported_names()
    assert not missing, f"{source} reads metrics no part of the server exports: {sorted(missing)}"


def test_dashboard_expressions_are_valid_promql(tmp_path):
    exprs = dashboard_exprs()
    for name, value in GRAFANA_VARIABLES.items():
        exprs = [e.replace(name, value) for e in exprs]
    assert not [e for e in exprs if "$" in e], "an unknown Grafana variable"
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    check = promtool("check", "rules", str(path))
    assert check.returncode == 0, check.stdout + check.stderr


def test_dashboard_has_the_slow_node_radar_over_exported_ranks_and_the_whole_group():
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    radar = json.dumps(panels["Own time per step, slowest exported ranks"])
    assert "elastic_ep_rank_step_seconds_sum" in radar and "elastic_ep_rank_collective_wait_seconds_sum" in radar
    assert "elastic_ep_group_own_seconds_bucket" in json.dumps(panels["Own time per step, whole group"])
    assert "elastic_ep_rank_exported" in json.dumps(panels["Why each rank is exported"])


def documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.utils.latest_version()])
def test_manifests_are_valid_against_the_kubernetes_schemas(version):
    docs = documents()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget"}
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name} {doc['kind']} {doc['metadata']['name']} is not valid Kubernetes {version}: {e}")


def kind(name: str) -> dict:
    return next(d for _, d in documents() if d["kind"] == name)


def test_probes_anti_affinity_disruption_budget_and_the_controller_flags():
    controller = kind("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert controller["livenessProbe"]["httpGet"]["path"] == "/health"
    assert controller["readinessProbe"]["httpGet"]["path"] == "/ready"
    args = [a.replace("$(POD_IP)", "10.0.0.5") for a in controller["args"]]
    parsed = command_parser(args[0]).parse_args(args[1:])  # the real CLI accepts every flag
    assert parsed.local_ranks == 0 and parsed.metrics_top_k == 16
    agents = kind("StatefulSet")["spec"]
    pod = agents["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= agents["template"]["metadata"]["labels"].items()
    budget = kind("PodDisruptionBudget")["spec"]
    assert budget["maxUnavailable"] == 1
    assert budget["selector"]["matchLabels"].items() <= agents["template"]["metadata"]["labels"].items()
    script = pod["containers"][0]["args"][0]
    agent_line = shlex.split(script[script.index("exec elastic-ep agent"):].replace("\\\n", " "))
    values = {"$ADDR": "tcp://10.0.0.1:5555", "$NODE_NAME": "n1", "$RANKS": "8", "$POD_IP": "10.0.0.6",
              "$MODE": "recover"}
    agent_args = command_parser("agent").parse_args([values.get(a, a) for a in agent_line[3:]])
    assert agent_args.ranks == 8 and agent_args.auto_recover


class _Answer404(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        self.server.posts.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def run_prestop(controller_url: str) -> subprocess.CompletedProcess:
    hook = kind("StatefulSet")["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == "python"
    env = {"CONTROLLER_URL": controller_url, "NODE_NAME": "node-7", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *hook[1:]], env=env, capture_output=True, text=True, timeout=30)


def test_the_prestop_drain_is_harmless_while_the_route_is_missing():
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Answer404)
    http.posts = []
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        done = run_prestop(f"http://127.0.0.1:{http.server_address[1]}")
    finally:
        http.shutdown()
        http.server_close()
    assert done.returncode == 0 and "not done" in done.stdout
    assert http.posts == [("/drain", {"node": "node-7"})]
    unreachable = run_prestop(f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == 0 and "not done" in unreachable.stdout
