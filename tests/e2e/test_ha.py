"""The controller group end to end (real etcd, three `serve --etcd` controllers and one `agent --etcd`
on network-namespace hosts, the router over them): a standby answers as a standby; streams through
the router outlive a `kill -9` of the leader's process, then the loss of the next leader's whole
host, with outputs identical to a fault-free run; each time a standby leads within the lease plus
2 s, in a higher term; the agent follows it without restarting, and keeps its workers though no
controller spoke to it for longer than its lease (it reached etcd); the new leader adopts the
running workers: the same processes, no checkpoint shard opened again (counted by the kernel), an
epoch over the same ranks and placement that filled no slot. The new leader runs the dead one's
journaled requests on by itself, on the KV the adopted ranks kept for them (only what the journal
confirms; the rest prefilled again, counted): a direct client's request reaches its fault-free end
with nobody attached, and the client re-attaches by its request id for only the tokens it lacks. A
drain, and a scale-up whose joiner still loads its weights, in flight at a takeover are resumed and
end as the last leader's would have."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from elastic_ep.group.record import read_record
from elastic_ep.group.store import GroupStore
from elastic_ep.harness.etcd import EtcdProcess
from elastic_ep.harness.file_opens import FileOpens
from elastic_ep.harness.load import PROMPTS, client_for, stream
from elastic_ep.harness.netns import netbed_unavailable
from elastic_ep.harness.router_process import RouterProcess
from elastic_ep.harness.server_process import ServerProcess, terminate
from elastic_ep.model.tiny import resolve_model

MODEL = "tiny-deepseek-v3"
LEASE_S = 5  # the default: a shorter lease loses its leader to a loaded machine (keepalives starved)
# the deployment with workers: its leader's keepalives compete with two ranks starting up (at load 33 on
# the shared machine 5 s went by without one); its agent keeps the default --lease-s, shorter than that
WORKERS_LEASE_S = 8
AGENT_LEASE_S = 5.0
MAX_TOKENS = 32


def role(server: ServerProcess) -> str | None:
    """The role /health gives, None while the server does not answer."""
    try:
        return server.http.get("/health").json().get("role")
    except httpx.TransportError:
        return None


def wait_role(server: ServerProcess, wanted: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while role(server) != wanted:
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log()[-2000:]
        time.sleep(0.05)


def leader_then_standby(args: list[str], tmp_path, started: list) -> tuple[ServerProcess, ServerProcess]:
    """c0 started and leading, then c1 (with c0's cluster key) started; both in `started`."""
    leader = ServerProcess([*args, "--node", "c0"], tmp_path / "c0.log", ready_timeout_s=None)
    started.append(leader)
    wait_role(leader, "leader")
    standby = ServerProcess([*args, "--node", "c1", "--cluster-key-file", str(leader.key_file)], tmp_path / "c1.log",
                            ready_timeout_s=None)
    started.append(standby)
    return leader, standby


class FirstToLead:
    """Polls `servers` from now on in a thread: the first of them to answer as the leader, and when."""

    def __init__(self, servers: list[ServerProcess]):
        self.server: ServerProcess | None = None
        self.at = 0.0
        self._thread = threading.Thread(target=self._poll, args=(servers,), daemon=True)
        self._thread.start()

    def _poll(self, servers: list[ServerProcess]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for server in servers:
                if role(server) == "leader":
                    self.server, self.at = server, time.monotonic()
                    return
            time.sleep(0.02)

    def wait(self) -> ServerProcess:
        self._thread.join(120)
        assert self.server is not None, "no standby leads"
        return self.server


def journal_when(server: ServerProcess, request_id: str, predicate, timeout_s: float = 60.0) -> dict:
    """GET /journal/{request_id} until predicate(answer) holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = server.http.get(f"/journal/{request_id}")
        assert r.status_code == 200, r.text
        if predicate(r.json()):
            return r.json()
        assert time.monotonic() < deadline, f"/journal/{request_id}: {r.text[:2000]}"
        time.sleep(0.05)


def resumed_by(server: ServerProcess, by: str) -> float:
    """elastic_ep_requests_resumed_total{by=...} of the server's /metrics (0 when absent)."""
    for line in server.http.get("/metrics").text.splitlines():
        if line.startswith(f'elastic_ep_requests_resumed_total{{by="{by}"}} '):
            return float(line.split()[1])
    return 0.0


def kept_kv(server: ServerProcess, cluster: dict) -> None:
    """The new leader took over the KV the adopted ranks held: every journaled request kept more positions
    than it prefilled again (with no KV kept, each would prefill its prompt and tokens, and keep none);
    /cluster and /metrics agree."""
    adopted = cluster["kv_cache"]["adopted"]
    assert adopted["requests_kept"] >= 1 and adopted["reused"] > adopted["reprefilled"], adopted
    metrics = server.http.get("/metrics").text
    assert f'elastic_ep_takeover_kv_positions_total{{fate="kept"}} {float(adopted["reused"])}' in metrics, adopted


def expected_ids(server: ServerProcess, prompt: str) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    return server.http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]


class DirectStream:
    """A client streaming straight from one controller (no router), in a thread: its request id
    and the token ids it got, and whether the stream broke."""

    def __init__(self, server: ServerProcess, prompt: str, max_tokens: int = MAX_TOKENS):
        self.request_id, self.ids, self.broken = "", [], False
        self.body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "return_token_ids": True}
        self.url = server.url
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        self.request_id = chunk["id"]
                        self.ids += chunk["choices"][0].get("token_ids", []) if chunk["choices"] else []
        except httpx.HTTPError:
            self.broken = True

    def wait_for(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.ids) < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the direct stream got no tokens"
            time.sleep(0.01)


def streams_through(router: RouterProcess, fault) -> tuple[list[str], float]:
    """Every prompt streamed through the router at once; `fault()` once each has 3 tokens. The texts,
    and when the fault was done (monotonic)."""
    client, model = client_for(router.url)
    barrier = threading.Barrier(len(PROMPTS) + 1, timeout=120)
    done: list[float] = []

    def one(prompt: str) -> str:
        return stream(client, model, prompt, MAX_TOKENS, lambda t: barrier.wait() if len(t) == 3 else None,
                      temperature=0).text

    def inject() -> None:
        barrier.wait()
        fault()
        done.append(time.monotonic())

    injector = threading.Thread(target=inject)
    injector.start()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(one, PROMPTS))
    injector.join()
    return texts, done[0]


@pytest.mark.skipif(netbed_unavailable() is not None, reason=str(netbed_unavailable()))
@pytest.mark.parametrize("journal_via", ["etcd", "direct"])
def test_streams_outlive_a_kill_9_of_the_leader_and_the_loss_of_its_host_and_the_ranks_are_adopted(tmp_path,
                                                                                                   journal_via):
    """Three controllers and the agent on hosts of their own (network namespaces; etcd and the router
    on the bridge): `kill -9` of the leader's process, then the loss of the next leader's whole host,
    each under streaming load through the router; the journal through etcd, or streamed by the leader
    to the standbys (--ha-journal-via direct), each new leader taking it from its own copy."""
    from elastic_ep.harness.netns import TestBed

    # a copy of its own: the kernel counts opens of its shards by any process, other tests' included
    model_dir = shutil.copytree(resolve_model(MODEL), tmp_path / "model")
    opens = None
    with TestBed(4) as bed:
        etcd = EtcdProcess(host=bed.bridge_addr)
        h0, h1, h2, node_host = bed.hosts
        started: list = []
        agent = None
        try:
            args = ["--model", str(model_dir), "--served-model-name", MODEL, "--ep-size", "2", "--max-model-len",
                    "256", "--etcd", etcd.url, "--ha-group", "g", "--ha-lease-s", str(WORKERS_LEASE_S),
                    "--ha-journal-via", journal_via]
            leader = ServerProcess([*args, "--node", "c0"], tmp_path / "c0.log", ready_timeout_s=None, host=h0.addr,
                                   port=8000, popen=h0.popen)
            started.append(leader)
            log = open(tmp_path / "agent.log", "w")  # noqa: SIM115 - the bed stops the process, the file closes with it
            agent = node_host.popen(  # it waits in etcd for a leader
                [sys.executable, "-m", "elastic_ep.cli", "agent", "--etcd", etcd.url, "--ha-group", "g", "--node",
                 "n0", "--ranks", "2", "--cluster-key-file", str(leader.key_file), "--connect-timeout-s", "180",
                 "--lease-s", str(AGENT_LEASE_S)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
            wait_role(leader, "leader", 180)
            standbys = [ServerProcess([*args, "--node", f"c{i}", "--cluster-key-file", str(leader.key_file)],
                                      tmp_path / f"c{i}.log", ready_timeout_s=None, host=h.addr, port=8000,
                                      popen=h.popen) for i, h in ((1, h1), (2, h2))]
            started += standbys
            host_of = {id(leader): h0, id(standbys[0]): h1, id(standbys[1]): h2}
            leader.wait_ready(180)
            first = leader.cluster()
            assert first["role"] == "leader" and first["group"]["leader"]["name"] == "c0"

            # a standby: alive, not ready, refuses /v1 with Retry-After and the leader's URL
            standby = standbys[0]
            wait_role(standby, "standby")
            group = standby.wait_for(lambda c: len(c["group"]["members"]) == 3 and c["group"]["leader"] is not None,
                                     60, "three controllers seated, the leader known")["group"]
            health = standby.http.get("/health")
            assert health.status_code == 200 and health.json()["role"] == "standby"
            assert standby.http.get("/ready").status_code == 503
            refused = standby.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.headers["X-Elastic-EP-Leader"] == leader.url
            assert refused.json()["error"]["code"] == "standby"
            assert group["role"] == "standby" and group["term"] == first["group"]["term"]
            assert {m["name"]: m["role"] for m in group["members"]} == {"c0": "leader", "c1": "standby",
                                                                        "c2": "standby"}
            client, model = client_for(leader.url)
            expected = [stream(client, model, p, MAX_TOKENS, temperature=0).text for p in PROMPTS]
            # the journal of those requests reached both standbys: their lag in /cluster comes to 0
            leader.wait_for(lambda c: [(m["journal_seq"] > 0, m["lag"]) for m in c["group"]["members"]
                                       if m["name"] != "c0"] == [(True, 0), (True, 0)], 30, "the standbys' journal")
            # and it went the way asked: batches in etcd, or none there (streamed to the standbys)
            assert bool(GroupStore(etcd.url, "g").get_prefix("/elastic-ep/g/journal")) == (journal_via == "etcd")
            # the cluster record the leader keeps in etcd reached the standby: its epoch and members
            seen = standby.wait_for(lambda c: (c["group"]["record"] or {}).get("epoch") == first["epoch"], 30,
                                    "the cluster record at the standby")
            assert seen["group"]["record"]["members"] == first["members"] == [0, 1]

            old_ranks = leader.pids()
            old_placement = first["placement"]["phy2log"]
            router = RouterProcess([arg for s in started for arg in ("--backend", s.url)] + [
                "--poll-interval-s", "0.2", "--queue-timeout-s", "150"], tmp_path / "router.log")
            started.append(router)
            router.wait_ready_backend(leader.url)
            assert not router.backends()[standby.url]["ready"]  # a standby gets nothing

            target = expected_ids(leader, PROMPTS[0])
            direct = DirectStream(leader, PROMPTS[0])

            # 1. kill -9 of the leader's process
            def kill() -> None:
                nonlocal opens
                direct.wait_for(3)
                opens = FileOpens(model_dir)  # from the first fault on: no process may read a weight again
                leader.proc.kill()  # SIGKILL of the leader's process alone: its agent and workers live elsewhere
                leader.proc.wait()

            watch = FirstToLead(standbys)
            texts, killed = streams_through(router, kill)
            assert texts == expected  # no request failed, outputs identical
            new = watch.wait()
            assert watch.at - killed < WORKERS_LEASE_S + 2.0
            # no controller spoke to the agent for longer than its lease: it reached etcd, so it fenced nothing
            assert watch.at - killed > AGENT_LEASE_S
            after = new.cluster()
            assert after["group"]["term"] > first["group"]["term"]
            kept_kv(new, after)
            assert agent.poll() is None  # the agent outlived the leader and follows the new one
            # the direct client: its stream broke. The new leader ran its request on by itself from the
            # journaled tokens, with nobody attached, to the fault-free end (kept for the orphan window)
            direct.thread.join(30)
            assert direct.broken and len(direct.ids) >= 3
            journaled = journal_when(new, direct.request_id, lambda j: j.get("finished"))
            assert journaled["resumed_by_leader"] and journaled["output_token_ids"] == target
            assert resumed_by(new, "leader") >= 1
            # it re-attaches by its request id with the tokens it got: only the rest comes, nothing runs again
            attached = resumed_by(new, "attach")
            resumed = new.http.post("/v1/completions", json={
                "model": model, "prompt": journaled["prompt_token_ids"], "max_tokens": MAX_TOKENS,
                "temperature": 0, "seed": journaled["seed"], "resume_request_id": journaled["request_id"],
                "resume_output_token_ids": direct.ids, "return_token_ids": True})
            assert direct.ids + resumed.json()["choices"][0]["token_ids"] == target
            assert resumed_by(new, "attach") == attached + 1
            assert new.http.get("/journal/cmpl-none").status_code == 404
            assert router.metric("elastic_ep_router_migrations_total") >= 1

            # 2. the loss of the new leader's whole host (every process in it killed at once)
            last = next(s for s in standbys if s is not new)
            wait_role(last, "standby")
            watch = FirstToLead([last])
            texts, lost = streams_through(router, host_of[id(new)].lose)
            assert texts == expected
            assert watch.wait() is last and AGENT_LEASE_S < watch.at - lost < WORKERS_LEASE_S + 2.0
            assert agent.poll() is None
            # the router's resumed streams attached to the requests the new leader already ran on
            assert resumed_by(last, "leader") >= 1 and resumed_by(last, "attach") >= 1
            kept_kv(last, last.cluster())
            # the direct client's request, finished on the last leader with nobody attached, outlived this
            # takeover in the journal: a client re-attaching now still gets it
            kept = journal_when(last, direct.request_id, lambda j: j.get("finished"), 5)
            assert kept["output_token_ids"] == target and kept["finish_reason"] == journaled["finish_reason"]

            # adopted, twice: the same worker processes, in an epoch past the old ones over the same ranks and
            # placement, which filled no slot; no shard of the checkpoint was opened since the first fault
            final = last.cluster()
            assert final["group"]["term"] > after["group"]["term"] and last.pids() == old_ranks
            assert final["epoch"] > after["epoch"] > first["epoch"] and final["members"] == first["members"]
            assert final["placement"]["phy2log"] == old_placement
            adopt = [e for e in final["events"] if e["kind"] == "epoch" and e.get("reason") == "adopt"]
            assert len(adopt) == 1 and adopt[0]["verified_slots"] == 0, adopt
            assert not any(t["bytes"] for t in adopt[0]["transfers"].values()), adopt
            taken = [e for e in final["events"] if e["kind"] == "adopted" and e["rank_id"] is None]
            assert taken[0]["whole"] == [0, 1], taken
            shards = {name: n for name, n in opens.close().items() if name.endswith(".safetensors")}
            assert shards == {}, shards
        finally:
            if opens is not None:
                opens.close()
            for proc in started:
                proc.stop()
            if agent is not None:
                terminate(agent, 10)
                assert not [p for p in psutil.process_iter() if p.ppid() == agent.pid]
            etcd.stop()


pytestmark = pytest.mark.timeout(400)


def test_a_leader_stopped_past_its_lease_is_replaced_and_exits_when_it_resumes(tmp_path):
    """SIGSTOP of the leader's process (a partition or a stall as seen by etcd) past its lease: the
    standby leads in a higher term; on SIGCONT the old leader's watchdog finds its leadership lapsed
    and the process exits (code 3) instead of serving as a second leader."""
    etcd = EtcdProcess()
    started: list[ServerProcess] = []
    try:
        args = ["--model", MODEL, "--ep-size", "2", "--local-ranks", "0", "--etcd", etcd.url, "--ha-group", "p",
                "--ha-lease-s", str(LEASE_S), "--startup-timeout-s", "300"]
        old, new = leader_then_standby(args, tmp_path, started)
        term = old.cluster()["group"]["term"]
        wait_role(new, "standby")
        old.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        wait_role(new, "leader", LEASE_S + 10)
        assert time.monotonic() - stopped < LEASE_S + 10
        assert new.cluster()["group"]["term"] > term
        old.proc.send_signal(signal.SIGCONT)
        assert old.proc.wait(20) == 3
        assert "no longer leads its group" in old.log()
        assert role(new) == "leader"
    finally:
        for proc in started:
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGCONT)
            proc.stop()
        etcd.stop()


def etcd_agent(etcd: EtcdProcess, group: str, node: str, ranks: int, key_file, log) -> subprocess.Popen:
    """`elastic-ep agent` of `node` finding group `group`'s leader through etcd, its output to `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "elastic_ep.cli", "agent", "--etcd", etcd.url, "--ha-group", group, "--node", node,
         "--ranks", str(ranks), "--cluster-key-file", str(key_file), "--connect-timeout-s", "180"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_drain_in_flight_at_a_takeover_is_resumed_by_the_new_leader(tmp_path):
    """A drain of rank 2, the leader killed (-9) as soon as it answered it: the drain is in the cluster
    record from its answer on, so the new leader adopts the three ranks, asks for the drain again, and it
    ends as the last leader's would have: rank 2 gone, ranks 0 and 1 serving on as the same processes,
    and every request the dead leader ran reaches its end (run on from the journal). A node drained
    before (an agent with no rank) stays cordoned under the new leader until POST /uncordon."""
    etcd = EtcdProcess()
    started: list[ServerProcess] = []
    agent = spare = None
    try:
        args = ["--model", MODEL, "--ep-size", "3", "--local-ranks", "0", "--redundant-experts", "8",
                "--max-model-len", "256", "--no-warmup-gate", "--scale-drain-timeout-s", "120", "--etcd", etcd.url,
                "--ha-group", "d", "--ha-lease-s", str(WORKERS_LEASE_S)]
        old = ServerProcess([*args, "--node", "c0"], tmp_path / "c0.log", ready_timeout_s=None)
        started.append(old)
        log = open(tmp_path / "agent.log", "w")  # noqa: SIM115 - closed with the process
        agent = etcd_agent(etcd, "d", "n0", 3, old.key_file, log)
        old.wait_ready(180)
        old.wait_full_group(3, 120)
        # a second node, given no rank (the group is full), drained: cordoned, its agent stops
        spare = etcd_agent(etcd, "d", "n1", 1, old.key_file, log)
        old.wait_for(lambda c: "n1" in [a["node"] for a in c["agents"]], 120, "node n1's agent")
        assert old.http.post("/drain", json={"node": "n1"}).json()["ranks"] == []
        assert spare.wait(30) == 0
        new = ServerProcess([*args, "--node", "c1", "--cluster-key-file", str(old.key_file)], tmp_path / "c1.log",
                            ready_timeout_s=None)
        started.append(new)
        wait_role(new, "standby")
        pids = old.pids()
        streams = [DirectStream(old, prompt, max_tokens=200) for prompt in PROMPTS[:6]]
        for s in streams:
            s.wait_for(1)
        # the requests in the journal the standby reads: the leader ships it every 0.05 s
        # (--ha-journal-flush-s), and a request admitted after the last shipment dies with a
        # leader killed -9 (by design; its client's re-attach is a 404 and runs it anew); ten
        # shipments, so a loaded machine's late one does not lose one of these
        time.sleep(0.5)
        assert old.http.post("/drain", json={"ranks": [2]}).status_code == 200
        old.proc.kill()  # as soon as it answered: sooner than the record's periodic write
        old.proc.wait()
        wait_role(new, "leader", WORKERS_LEASE_S + 30)
        deadline = time.monotonic() + 120
        while (status := new.http.get("/is_scaling_elastic_ep").json()).get("scale_phase") != "serving_shrunk":
            assert time.monotonic() < deadline and status.get("scale_phase") != "failed", status
            time.sleep(0.1)
        cluster = new.wait_for(lambda c: [r["rank_id"] for r in c["ranks"]] == [0, 1], 60, "rank 2 gone")
        assert cluster["members"] == [0, 1] and {r: pids[r] for r in (0, 1)} == new.pids()
        assert any(e["kind"] == "scale" and e.get("resumed") for e in cluster["events"]), cluster["events"]
        assert cluster["cordoned"] == ["n1"]
        assert new.http.post("/uncordon", json={"node": "n1"}).status_code == 200
        for s in streams:
            s.thread.join(30)
            assert s.broken and s.request_id
            journal_when(new, s.request_id, lambda j: j.get("finished"), 120)
    finally:
        for proc in started:
            proc.stop()
        for proc in (agent, spare):
            if proc is not None:
                terminate(proc, 10)
        etcd.stop()


def test_a_scale_up_in_flight_at_a_takeover_completes_with_its_joiner_still_loading(tmp_path):
    """A scale-up 2 -> 3 whose joiner still reads its dense weights from disk (--no-expert-backup, and
    --load-read-rate-mb-s makes the read last seconds) when the leader is killed (-9): the joiner, not
    registered with the dead leader, follows the new one once loaded, as the same process, and the
    resumed scale admits it: three ranks serve, each the process the last leader started."""
    etcd = EtcdProcess()
    started: list[ServerProcess] = []
    agent = None
    try:
        args = ["--model", MODEL, "--ep-size", "2", "--local-ranks", "0", "--no-warmup-gate", "--no-expert-backup",
                "--load-read-rate-mb-s", "0.12", "--etcd", etcd.url, "--ha-group", "j",
                "--ha-lease-s", str(WORKERS_LEASE_S)]
        old = ServerProcess([*args, "--node", "c0"], tmp_path / "c0.log", ready_timeout_s=None)
        started.append(old)
        log = open(tmp_path / "agent.log", "w")  # noqa: SIM115 - closed with the process
        agent = etcd_agent(etcd, "j", "n0", 3, old.key_file, log)
        old.wait_ready(240)
        old.wait_full_group(2, 120)
        new = ServerProcess([*args, "--node", "c1", "--cluster-key-file", str(old.key_file)], tmp_path / "c1.log",
                            ready_timeout_s=None)
        started.append(new)
        wait_role(new, "standby")
        pids = old.pids()
        assert old.http.post("/scale_elastic_ep", json={"new_ep_size": 3}).status_code == 200
        store, deadline = GroupStore(etcd.url, "j"), time.monotonic() + 30
        while ((read_record(store) or {}).get("scale") or {}).get("new_ranks") != [2]:
            assert time.monotonic() < deadline, read_record(store)
            time.sleep(0.05)
        cluster = old.wait_for(lambda c: any(r["rank_id"] == 2 and r["pid"] for r in c["ranks"]), 30, "rank 2 started")
        joiner_pid = next(r["pid"] for r in cluster["ranks"] if r["rank_id"] == 2)
        registered = [e for e in old.cluster()["events"] if e["kind"] == "registered" and e["rank_id"] == 2]
        old.proc.kill()
        old.proc.wait()
        assert not registered, "the joiner had loaded before the leader died"
        wait_role(new, "leader", WORKERS_LEASE_S + 30)
        deadline = time.monotonic() + 180
        # 503 while its controller still starts (serve/group_gate.py)
        while (status := new.http.get("/is_scaling_elastic_ep").json()).get("scale_phase") != "serving_expanded":
            assert time.monotonic() < deadline and status.get("scale_phase") != "failed", status
            time.sleep(0.1)
        assert status["effective_ep_size"] == 3, status  # the scale admitted its joiner, not a later rejoin
        cluster = new.wait_full_group(3, 120)
        assert new.pids() == {**pids, 2: joiner_pid}
        assert any(e["kind"] == "registered" and e["rank_id"] == 2 and "adopt" in e["message"]
                   for e in cluster["events"]), cluster["events"]
        assert any(e["kind"] == "scale" and e.get("resumed") for e in cluster["events"]), cluster["events"]
    finally:
        for proc in started:
            proc.stop()
        if agent is not None:
            terminate(agent, 10)
        etcd.stop()
