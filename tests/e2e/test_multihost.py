"""Across hosts for real: three network-namespace hosts on a bridge (elastic_ep.harness.netns).
Host A runs the controller alone (`serve --local-ranks 0`), hosts B and C run `elastic-ep agent`
with two ranks each, every process bound to its own host's address. Under streaming load, with
every output equal to the fault-free run and no failed request: the group forms; delay and loss
on C's link cause no false fault (C's ranks show a slower link); a cut of C's link makes C fence
itself within its lease while B serves, and healing it brings C's ranks back by themselves; the
loss of every process of C is recovered on B. Only C's ranks are ever dropped. The agents gather
their ranks' step results (--step-results-via agent), so a cut host loses those with its link.

The tests share one test bed and run in file order.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from elastic_ep.harness.load import streams_with_fault
from elastic_ep.harness.netns import netbed_unavailable

from .conftest import PROMPTS, Server, reference, reference_load

MODEL = "tiny-deepseek-v3"
MAX_TOKENS = 32
LEASE_S = 3.0
# 16 experts + 16 redundant over 4 ranks: 8 slots per rank, so one host's two ranks hold every expert
SERVE_ARGS = ["--model", MODEL, "--ep-size", "4", "--local-ranks", "0", "--redundant-experts", "16",
              "--restart-delay-s", "-1", "--lease-s", str(LEASE_S), "--enable-chaos"]

pytestmark = pytest.mark.skipif(netbed_unavailable() is not None, reason=str(netbed_unavailable()))


@pytest.fixture(scope="module")
def bed():
    from elastic_ep.harness.netns import TestBed

    with TestBed(3) as bed:
        yield bed


@pytest.fixture(scope="module")
def cluster(bed, tmp_path_factory):
    a, b, c = bed.hosts
    logs = tmp_path_factory.mktemp("multihost")
    server = Server(SERVE_ARGS, logs / "serve.log", ready_timeout_s=None, host=a.addr, port=8000, popen=a.popen)
    agents = {}
    try:
        for name, host in (("hostB", b), ("hostC", c)):
            agents[name] = start_agent(host, name, server, logs, "initial")
        server.wait_ready(180)
        server.wait_full_group(4, 120)
        yield server, agents, logs
    finally:
        server.stop()


def start_agent(host, name: str, server: Server, logs, join_mode: str) -> subprocess.Popen:
    log = open(logs / f"{name}.log", "a")  # noqa: SIM115 - the bed stops the process, the file closes with it
    return host.popen([sys.executable, "-m", "elastic_ep.cli", "agent", "--controller", server.controller_addr(),
                       "--node", name, "--cluster-key-file", str(server.key_file), "--ranks", "2",
                       "--lease-s", str(LEASE_S), "--join-mode", join_mode, "--step-results-via", "agent"],
                      stdout=log, stderr=subprocess.STDOUT)


def _addr(field: str) -> tuple[str, int]:
    addr, _, port = field.rpartition(":")
    return addr.removeprefix("[::ffff:").rstrip("]"), int(port)


def local_addresses(host, pid: int) -> set[str]:
    """The local addresses of the established TCP connections of `pid`, read inside its host, less
    its loopback connections to its own agent (node-local by design: checked to go to ports its
    parent, the agent, listens on): its heartbeat thread's to the beat socket, its main thread's to
    the result socket (the agents run with --step-results-via agent)."""
    lines = [line.split() for line in host.run(["ss", "-Htnp", "state", "established"]).stdout.splitlines()
             if f"pid={pid}," in line]
    parent = psutil.Process(pid).ppid()
    agent_ports = {_addr(line.split()[3])[1] for line in host.run(["ss", "-Htlnp"]).stdout.splitlines()
                   if f"pid={parent}," in line}
    to_agent = [f for f in lines if _addr(f[2])[0] == "127.0.0.1" and _addr(f[3])[1] in agent_ports]
    assert len(to_agent) == 2, lines  # the heartbeat thread's and the step results', to its agent
    return {_addr(f[2])[0] for f in lines if f not in to_agent}


def stream_all(server, inject=lambda: None) -> list[str]:
    """Six concurrent greedy streams; inject() once each has its first chunk; their texts."""
    return [r.text for r in streams_with_fault(server.url, inject, PROMPTS, MAX_TOKENS, temperature=0)]


def ranks_on(cluster: dict, node: str) -> list[dict]:
    return [r for r in cluster["ranks"] if r["node"] == node]


def expected() -> list[str]:
    return list(reference(MODEL, tuple(PROMPTS), MAX_TOKENS))


def test_the_group_forms_across_hosts_each_rank_bound_to_its_hosts_address(bed, cluster):
    server, _, _ = cluster
    _, b, c = bed.hosts
    state = server.cluster()
    assert sorted(r["node"] for r in state["ranks"]) == ["hostB", "hostB", "hostC", "hostC"]
    assert state["controller"].startswith(f"tcp://{bed.hosts[0].addr}:")
    for host, node in ((b, "hostB"), (c, "hostC")):
        for rank in ranks_on(state, node):
            local = local_addresses(host, rank["pid"])
            assert local == {host.addr}, (node, local)  # data and control plane on the host's own address
    # read once, copy many: each host read from storage and copied the experts the other backs up from it
    loaded = state["cold_start"]["bytes"]
    assert all(loaded[node]["storage"] > 0 and loaded[node]["peer"] > 0 for node in ("hostB", "hostC")), loaded
    assert stream_all(server) == expected()


def test_delay_and_loss_on_a_link_are_no_fault_and_show_as_a_slower_link(bed, cluster):
    server, _, _ = cluster
    c = bed.hosts[2]
    before = server.wait_full_group(4)
    c.set_link(delay_ms=20, loss_pct=1)
    try:
        with reference_load(server, MODEL, threads=3, max_tokens=MAX_TOKENS) as load:
            load.wait_done(6)
        after = server.cluster()
    finally:
        c.set_link()
    assert not load.failures, load.failures[:3]
    assert after["epoch"] == before["epoch"]
    assert not [e for e in after["events"] if e["kind"] == "fault" and e["id"] > before["events"][-1]["id"]]
    slow = min(r["link_ms"]["p50"] for r in ranks_on(after, "hostC"))
    fast = max(r["link_ms"]["p50"] for r in ranks_on(after, "hostB"))
    assert slow > fast and slow >= 20  # the control plane crosses C's delayed link


def test_a_cut_host_fences_itself_the_rest_serves_and_heal_brings_it_back(bed, cluster):
    server, _, logs = cluster
    c = bed.hosts[2]
    before = server.wait_full_group(4)
    c_pids = [r["pid"] for r in ranks_on(before, "hostC")]
    cut_at = {}

    def cut():
        cut_at["t"] = time.monotonic()
        c.cut()

    try:
        assert stream_all(server, cut) == expected()
        during = server.wait_for(lambda s: s["ready"] and len(s["members"]) == 2, what="serving on hostB alone")
        assert all(r["node"] == "hostB" for r in during["ranks"] if r["rank_id"] in during["members"])
        # the cut side stops by itself (the controller cannot reach it): its workers are gone within the lease
        deadline = cut_at["t"] + LEASE_S + 5
        while any(psutil.pid_exists(p) for p in c_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(psutil.pid_exists(p) for p in c_pids), "hostC's ranks outlived its lease"
        assert c.is_cut and "fenced its 2 ranks" in (logs / "hostC.log").read_text()
    finally:
        c.heal()
    back = server.wait_full_group(4, 120)
    assert sorted(r["node"] for r in back["ranks"]) == ["hostB", "hostB", "hostC", "hostC"]
    lost = [e for e in back["events"] if e["kind"] == "node-lost" and e["id"] > before["events"][-1]["id"]]
    assert [e["node"] for e in lost] == ["hostC"]
    faults = [e for e in back["events"] if e["kind"] == "fault" and e["id"] > before["events"][-1]["id"]]
    assert {e["rank_id"] for e in faults} == {r["rank_id"] for r in ranks_on(before, "hostC")}


def test_losing_every_process_of_a_host_is_recovered_on_the_others(bed, cluster):
    server, agents, logs = cluster
    c = bed.hosts[2]
    before = server.wait_full_group(4)
    assert stream_all(server, c.lose) == expected()
    after = server.wait_for(lambda s: s["ready"] and len(s["members"]) == 2, what="serving on hostB alone")
    faults = [e for e in after["events"] if e["kind"] == "fault" and e["id"] > before["events"][-1]["id"]]
    assert {e["rank_id"] for e in faults} == {r["rank_id"] for r in ranks_on(before, "hostC")}
    # a new agent on the host (a repaired machine) takes its ranks back
    agents["hostC"] = start_agent(c, "hostC", server, logs, "recover")
    server.wait_full_group(4, 120)
