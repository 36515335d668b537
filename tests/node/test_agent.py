"""A real node agent with real worker processes, driven by a stand-in controller (two ZeroMQ
ROUTER sockets and a TCPStore): it starts ranks and reports them, fences one and confirms,
reports another's death with its exit code, writes its backup and serves it to another node, and
on shutdown stops everything and removes the backup file; with --step-results-via agent it forwards
its ranks' step results in one node frame and drops what is not theirs; with --step-plans-via agent
it relays its node's plans to its workers as the controller sealed them."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import msgspec
import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist
import zmq

from elastic_ep.doctor.stacks import worker_process
from elastic_ep.harness.server_process import free_port
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.tiny import resolve_model
from elastic_ep.node.agent import NodeAgent
from elastic_ep.node.exits import exit_code, open_stat
from elastic_ep.runtime.experts import fetch_backup
from elastic_ep.wire import (
    ALL_MESSAGES,
    AbortEpoch,
    AgentAlive,
    AgentBye,
    AgentHello,
    AgentShutdown,
    AgentWelcome,
    BackupAssign,
    BackupReady,
    ClusterKey,
    FenceWorker,
    LeaseRenew,
    NodeHeartbeat,
    NodeStepResults,
    RankBeat,
    SignalWorker,
    StartWorker,
    StepPlan,
    StepResult,
    WorkerExited,
    WorkerFenced,
    WorkerHello,
    WorkerLaunch,
    WorkerStarted,
    WorkerStartFailed,
    decoder,
    node_step_plans,
    rejected_counts,
)
from elastic_ep.wire.codec import HMAC_BYTES

from .test_zygote import pids_cgroup

KEY = ClusterKey.generate()
ANY = decoder(ALL_MESSAGES)


class StandInController:
    def __init__(self):
        ctx = zmq.Context.instance()
        self.health, self.step = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        for s in (self.health, self.step):
            s.setsockopt(zmq.LINGER, 0)
        self.health_addr = f"tcp://127.0.0.1:{self.health.bind_to_random_port('tcp://127.0.0.1')}"
        self.step_addr = f"tcp://127.0.0.1:{self.step.bind_to_random_port('tcp://127.0.0.1')}"
        self.store_port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.store_port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.agent_identity = b""
        self.session = ""
        self.renewing = True

    def expect(self, sock, kind, timeout_s: float = 60.0):
        """The next message of type `kind` on `sock` (others are skipped). Meanwhile the agent's
        lease is renewed, unless `renewing` is off."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        for s in {sock, self.health}:
            poller.register(s, zmq.POLLIN)
        while time.monotonic() < deadline:
            for ready in dict(poller.poll(100)):
                identity, mac, body = ready.recv_multipart()
                assert mac == KEY.mac(body, int.from_bytes(mac[HMAC_BYTES:], "big"))
                msg = ANY.decode(body)
                if isinstance(msg, AgentAlive) and self.renewing:
                    self.health.send_multipart([identity, *KEY.seal(LeaseRenew(msg.session, 5.0))])
                if ready is sock and isinstance(msg, kind):
                    if isinstance(msg, AgentHello):
                        self.agent_identity, self.session = identity, msg.session
                    return msg
        raise TimeoutError(f"no {kind.__name__} within {timeout_s}s")

    def expect_beat(self, until, timeout_s: float = 60.0) -> dict[int, RankBeat]:
        """The ranks' entries (rank -> RankBeat) of the agent's next NodeHeartbeat for which `until` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.expect(self.health, NodeHeartbeat, max(deadline - time.monotonic(), 0.1))
            assert msg.node == "nodeT" and msg.session == self.session
            beats = {b.rank_id: b for b in msg.beats}
            if until(beats):
                return beats

    def launch(self, **fields) -> WorkerLaunch:
        """The tiny model's launch against this controller's sockets and store (`fields` replaced)."""
        launch = WorkerLaunch(str(resolve_model("tiny-deepseek-v3")), self.step_addr, self.health_addr, "127.0.0.1",
                              self.store_port, "gloo", 4, 64, 0.1)
        return msgspec.structs.replace(launch, **fields)

    def welcome(self, launch) -> None:
        self.to_agent(AgentWelcome(launch, self.session))

    def to_agent(self, msg) -> None:
        self.health.send_multipart([self.agent_identity, *KEY.seal(msg)])

    def close(self) -> None:
        self.health.close()
        self.step.close()


def running(agent: NodeAgent) -> tuple[threading.Event, threading.Thread]:
    """`agent` run on a thread of its own until the event returned is set."""
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def can_no_longer_run(pid: int) -> bool:
    """Gone, or its exit has begun (the agent confirms a fence then, before the kernel has freed it).
    A process reaped between the open and the read reads as running to `exit_code`, hence the
    second look for its /proc entry."""
    try:
        fd = open_stat(pid)
    except FileNotFoundError:
        return True
    try:
        return exit_code(fd) is not None or not os.path.exists(f"/proc/{pid}")
    finally:
        os.close(fd)


def stop_agent(stop: threading.Event, thread: threading.Thread, pids: list[int], ctl: StandInController) -> None:
    """A test's teardown: the agent thread stopped, any worker it left SIGKILLed, the controller closed."""
    stop.set()
    thread.join(10)
    for pid in pids:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
    ctl.close()


@pytest.mark.e2e
def test_agent_runs_fences_reports_and_cleans_up_its_workers(tmp_path):
    ctl = StandInController()
    agent = NodeAgent(ctl.health_addr, "nodeT", KEY, num_ranks=2, stop_grace_s=2.0)
    stop, thread = running(agent)
    pids: list[int] = []
    try:
        hello = ctl.expect(ctl.health, AgentHello)
        assert (hello.node, hello.num_ranks, hello.fetch_addr) == ("nodeT", 2, agent.fetch_addr)
        launch = ctl.launch()
        ctl.welcome(launch)
        for rank in (0, 1):
            ctl.to_agent(StartWorker(rank, "initial"))
        reports = [ctl.expect(ctl.health, WorkerStarted) for _ in range(2)]
        assert {m.session for m in reports} == {hello.session}  # the controller takes them as this session's
        started = {m.rank_id: m.pid for m in reports}
        pids = list(started.values())
        registered = {m.rank_id: m for m in (ctl.expect(ctl.step, WorkerHello) for _ in range(2))}
        assert {r: m.pid for r, m in registered.items()} == started
        # read once, copy many: the agent staged the dense weights in shared memory, the ranks mapped them
        assert all(m.dense_source == "host_memory" and m.node == "nodeT" for m in registered.values())

        # the workers' heartbeat threads beat to the agent; it sends one message for both ranks
        beat = ctl.expect_beat(lambda b: len(b) == 2)
        assert {r: e.pid for r, e in beat.items()} == started and beat[1].age_s < 1.0
        ctl.to_agent(SignalWorker(1, started[1], signal.SIGSTOP))  # stopped: its entry stays, ever older
        stopped = ctl.expect_beat(lambda b: b[1].age_s > 1.0)
        assert stopped[0].age_s < 1.0 and stopped[1].pid == started[1]
        ctl.to_agent(SignalWorker(1, started[1], signal.SIGCONT))
        ctl.expect_beat(lambda b: b[1].age_s < 0.5)

        ctl.to_agent(FenceWorker(0, started[0], "test fence"))
        fenced = ctl.expect(ctl.health, WorkerFenced)
        assert (fenced.rank_id, fenced.pid) == (0, started[0]) and can_no_longer_run(started[0])

        ctl.to_agent(SignalWorker(1, started[1], signal.SIGKILL))
        exited = ctl.expect(ctl.health, WorkerExited)
        assert (exited.rank_id, exited.pid, exited.returncode) == (1, started[1], -signal.SIGKILL)

        ctl.to_agent(BackupAssign([(0, 0), (1, 5)]))
        ready = ctl.expect(ctl.health, BackupReady, timeout_s=60)
        assert ready.experts == [(0, 0), (1, 5)] and os.path.exists(ready.site.path) and ready.nbytes > 0
        w13, w2 = fetch_backup(agent.fetch_addr, [(1, 5)], 10, KEY)  # what another node's worker asks
        reader = CheckpointReader(launch.model_dir)
        e13, e2 = reader.read_experts(reader.config.moe_layers[1], [5])
        assert torch.equal(w13, e13) and torch.equal(w2, e2)

        ctl.to_agent(AgentShutdown())
        ctl.expect(ctl.health, AgentBye)
        thread.join(10)
        assert not thread.is_alive() and not os.path.exists(ready.site.path)
    finally:
        stop_agent(stop, thread, pids, ctl)


@pytest.mark.e2e
def test_a_start_the_os_refuses_is_reported_and_the_node_goes_on():
    """The kernel refuses a worker's exec (--worker-start exec): here its one argument is longer than
    MAX_ARG_STRLEN (E2BIG), as a fork refused for memory or by the node's pids.max would be (the
    next test has the zygote's fork refused). The agent reports
    `WorkerStartFailed` with the reason, in its session, and goes on: the rank it runs keeps running
    and the next start of the refused rank succeeds. Before, the error ended the agent's thread and
    every rank of the node with it. So did any other order it could not carry out, such as a signal
    the kernel refuses."""
    ctl = StandInController()
    agent = NodeAgent(ctl.health_addr, "nodeS", KEY, num_ranks=2, stop_grace_s=2.0, worker_start="exec")
    stop, thread = running(agent)
    pids: list[int] = []
    try:
        hello = ctl.expect(ctl.health, AgentHello)
        launch = ctl.launch(read_once=False)
        ctl.welcome(launch)
        assert ctl.expect(ctl.health, AgentAlive).zygote == "off"  # --worker-start exec
        ctl.to_agent(StartWorker(0, "initial"))
        first = ctl.expect(ctl.health, WorkerStarted)
        pids.append(first.pid)
        too_long = msgspec.structs.replace(launch, model_dir=launch.model_dir + "/" + "x" * (256 << 10))
        ctl.to_agent(StartWorker(1, "initial", launch=too_long))
        failed = ctl.expect(ctl.health, WorkerStartFailed)
        assert (failed.node, failed.rank_id, failed.session) == ("nodeS", 1, hello.session)
        assert "Argument list too long" in failed.reason, failed.reason
        assert thread.is_alive() and not can_no_longer_run(first.pid)
        # an order it cannot carry out for any other reason (a signal number the kernel refuses, EINVAL):
        # logged, and the node goes on (the start below is read after it, on the same socket)
        ctl.to_agent(SignalWorker(0, first.pid, 999))

        ctl.to_agent(StartWorker(1, "initial", launch=launch))
        again = ctl.expect(ctl.health, WorkerStarted)
        pids.append(again.pid)
        assert again.rank_id == 1 and again.started_by == "exec" and thread.is_alive()
        assert not can_no_longer_run(first.pid)
    finally:
        stop_agent(stop, thread, pids, ctl)


@pytest.mark.e2e
def test_ranks_fork_from_the_zygote_and_a_fork_the_pids_limit_refuses_is_one_failed_start():
    """--worker-start fork (the default): the agent registers once its zygote imported the worker,
    and its ranks are forked from there: each is the agent's child (this process: the agent runs in
    a thread here) and shows its rank in its title, where `elastic-ep doctor` looks for it. A fork
    the kernel refuses (the zygote's cgroup at its pids.max) is reported as `WorkerStartFailed` with
    the kernel's reason, the running rank is untouched, and the rank forks once the limit is lifted."""
    group = pids_cgroup(f"elastic-ep-agent-test-{os.getpid()}")
    if group is None:
        pytest.skip("no writable pids cgroup on this host")
    ctl = StandInController()
    agent = NodeAgent(ctl.health_addr, "nodeZ", KEY, num_ranks=2, stop_grace_s=2.0)
    stop, thread = running(agent)
    pids: list[int] = []
    try:
        hello = ctl.expect(ctl.health, AgentHello, timeout_s=90)
        assert agent.zygote is not None and agent.zygote.ready
        ctl.welcome(ctl.launch(read_once=False))
        assert ctl.expect(ctl.health, AgentAlive).zygote == "ready"  # what /cluster shows of the node
        ctl.to_agent(StartWorker(0, "initial"))
        first = ctl.expect(ctl.health, WorkerStarted)
        pids.append(first.pid)
        assert first.started_by == "fork" and psutil.Process(first.pid).ppid() == os.getpid()
        assert ctl.expect(ctl.step, WorkerHello).pid == first.pid  # it runs: it registered on the step socket
        assert worker_process(first.pid, 0) is not None and worker_process(first.pid, 1) is None

        (group / "pids.max").write_text("1")
        (group / "cgroup.procs").write_text(str(agent.zygote.proc.pid))
        ctl.to_agent(StartWorker(1, "initial"))
        failed = ctl.expect(ctl.health, WorkerStartFailed)
        assert (failed.node, failed.rank_id, failed.session) == ("nodeZ", 1, hello.session)
        assert "Resource temporarily unavailable" in failed.reason, failed.reason
        assert thread.is_alive() and not can_no_longer_run(first.pid)

        (group / "pids.max").write_text("max")
        ctl.to_agent(StartWorker(1, "initial"))
        again = ctl.expect(ctl.health, WorkerStarted)
        pids.append(again.pid)
        assert again.rank_id == 1 and psutil.Process(again.pid).ppid() == os.getpid()
    finally:
        stop_agent(stop, thread, pids, ctl)
        for pid in (group / "cgroup.procs").read_text().split():
            (group.parent / "cgroup.procs").write_text(pid)
        group.rmdir()


@pytest.mark.e2e
def test_agent_removes_its_backup_when_the_controller_goes_away():
    """The controller's socket closes (as when its process dies): the agent removes the backup
    file at once instead of leaving it in /dev/shm."""
    ctl = StandInController()
    agent = NodeAgent(ctl.health_addr, "nodeC", KEY)
    stop, thread = running(agent)
    try:
        ctl.expect(ctl.health, AgentHello)
        launch = ctl.launch(heartbeat_interval_s=0.0)
        ctl.welcome(launch)
        ctl.to_agent(BackupAssign([(0, 1)]))
        path = ctl.expect(ctl.health, BackupReady, timeout_s=60).site.path
        assert os.path.exists(path)
        ctl.close()
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path) and agent.backup.path is None
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.e2e
def test_an_agent_that_stops_hearing_the_controller_fences_its_ranks_and_registers_again():
    """The lease: with no answer for lease_s the agent kills its workers itself (the controller
    could not reach it to do so) and asks to be welcomed again, in recover mode, under a new session."""
    ctl = StandInController()
    agent = NodeAgent(ctl.health_addr, "nodeL", KEY, num_ranks=1, lease_s=1.0)
    stop, thread = running(agent)
    pid = None
    try:
        first = ctl.expect(ctl.health, AgentHello)
        launch = ctl.launch(heartbeat_interval_s=0.0)
        ctl.welcome(launch)
        ctl.to_agent(StartWorker(0, "initial"))
        pid = ctl.expect(ctl.health, WorkerStarted).pid
        ctl.expect(ctl.step, WorkerHello)
        ctl.renewing = False  # the controller goes silent, as behind a cut link
        fenced = ctl.expect(ctl.health, WorkerFenced, timeout_s=10)
        assert fenced.pid == pid and can_no_longer_run(pid)
        again = ctl.expect(ctl.health, AgentHello, timeout_s=10)
        assert again.join_mode == "recover" and again.session != first.session
    finally:
        stop_agent(stop, thread, [pid] if pid is not None else [], ctl)


@pytest.mark.e2e
def test_agent_forwards_its_ranks_step_results_in_one_node_frame_and_drops_the_rest():
    """--step-results-via agent: a result on the agent's result socket for a rank it runs goes to the
    controller in a `NodeStepResults` of its session; one for a rank it does not run is not
    forwarded, and a junk frame is dropped and counted."""
    ctl = StandInController()
    agent = NodeAgent(ctl.health_addr, "nodeR", KEY, num_ranks=1, stop_grace_s=2.0, step_results_via="agent")
    stop, thread = running(agent)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(agent.result_addr)
    pids: list[int] = []
    try:
        ctl.expect(ctl.health, AgentHello)
        launch = ctl.launch()
        ctl.welcome(launch)
        ctl.to_agent(StartWorker(0, "initial"))
        pids.append(ctl.expect(ctl.health, WorkerStarted).pid)
        rejected = rejected_counts().get(("agent_results", "nodeR", "unauthenticated"), 0)

        def result(rank_id: int) -> StepResult:
            return StepResult(1, 9, rank_id, {3: 5}, 0.02, 0.02, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {})
        push.send_multipart([b"junk"])
        push.send_multipart(KEY.seal(result(7)))  # not a rank of this agent
        push.send_multipart(KEY.seal(result(0)))
        forwarded = ctl.expect(ctl.health, NodeStepResults)
        assert (forwarded.node, forwarded.session) == ("nodeR", ctl.session)
        assert (forwarded.epoch, forwarded.step, forwarded.rank_ids) == (1, 9, [0])
        assert (forwarded.token_counts, forwarded.seq_ids, forwarded.tokens) == ([1], [3], [5])
        assert rejected_counts().get(("agent_results", "nodeR", "unauthenticated"), 0) == rejected + 1
    finally:
        push.close()
        stop_agent(stop, thread, pids, ctl)


def test_agent_relays_one_abort_epoch_to_the_heartbeat_thread_of_each_rank_it_names():
    """The controller sends one `AbortEpoch` a node naming its ranks; the agent relays it, sealed by
    the cluster key, to the beat link of each rank named and of no other."""
    ctl = StandInController()
    agent = NodeAgent(ctl.health_addr, "nodeA", KEY)
    stop, thread = running(agent)
    links = {}
    for rank_id in (3, 5, 9):  # as the workers' heartbeat threads connect
        links[rank_id] = zmq.Context.instance().socket(zmq.DEALER)
        links[rank_id].setsockopt(zmq.LINGER, 0)
        links[rank_id].setsockopt(zmq.IDENTITY, f"h{rank_id}".encode())
        links[rank_id].connect(agent.beat_addr)
    try:
        ctl.expect(ctl.health, AgentHello)
        ctl.welcome(WorkerLaunch("/m", ctl.step_addr, ctl.health_addr, "127.0.0.1", ctl.store_port, "gloo", 4, 64, 0.0))
        got: dict[int, AbortEpoch] = {}
        deadline = time.monotonic() + 30
        while len(got) < 2:  # again until both links were up when the agent relayed it
            assert time.monotonic() < deadline, f"relayed only to {sorted(got)}"
            ctl.to_agent(AbortEpoch(4, [3, 5]))
            for rank_id, link in links.items():
                while link.poll(200 if rank_id not in got else 0):
                    mac, body = link.recv_multipart()
                    assert mac == KEY.mac(body, int.from_bytes(mac[HMAC_BYTES:], "big"))
                    got[rank_id] = ANY.decode(body)
        assert sorted(got) == [3, 5] and all(m.epoch == 4 and m.rank_ids == [3, 5] for m in got.values())
    finally:
        for link in links.values():
            link.close()
        stop_agent(stop, thread, [], ctl)


def test_agent_relays_its_nodes_plans_as_they_came_and_drops_junk():
    """--step-plans-via agent: once welcomed the agent connects to the plan socket the launch names,
    and each frame the controller sends there reaches the node's workers' SUB sockets byte for byte
    (the controller's seal, not the agent's); a frame without the cluster key's MAC is dropped and
    counted, never relayed."""
    ctl = StandInController()
    plans = zmq.Context.instance().socket(zmq.ROUTER)
    plans.setsockopt(zmq.LINGER, 0)
    plans.setsockopt(zmq.ROUTER_MANDATORY, 1)
    plan_addr = f"tcp://127.0.0.1:{plans.bind_to_random_port('tcp://127.0.0.1')}"
    agent = NodeAgent(ctl.health_addr, "nodeP", KEY, step_plans_via="agent")
    stop, thread = running(agent)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(agent.plan_relay_addr)
    try:
        ctl.expect(ctl.health, AgentHello)
        ctl.welcome(WorkerLaunch("/m", ctl.step_addr, ctl.health_addr, "127.0.0.1", ctl.store_port, "gloo", 4, 64,
                                 0.0, plan_addr=plan_addr))
        sealed = KEY.seal(node_step_plans("nodeP", [(3, StepPlan(2, 40, [], [])), (5, StepPlan(2, 40, [], [7]))]))
        rejected = rejected_counts().get(("agent_plans", "nodeP", "unauthenticated"), 0)
        deadline = time.monotonic() + 30
        while True:  # mandatory routing: refused until the agent's plan link is up
            try:
                plans.send_multipart([b"pnodeP", b"junk", b"frame"])
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, "the agent never connected its plan link"
                time.sleep(0.05)
        plans.send_multipart([b"pnodeP", *sealed])
        assert sub.poll(10_000)
        assert [bytes(f) for f in sub.recv_multipart()] == sealed  # the junk frame never came
        assert rejected_counts().get(("agent_plans", "nodeP", "unauthenticated"), 0) == rejected + 1
    finally:
        sub.close()
        plans.close()
        stop_agent(stop, thread, [], ctl)
