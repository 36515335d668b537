"""The node agent: starts and supervises the node's workers, fences them on order, and keeps
the node's share of the expert backup in shared memory.

With `worker_start="fork"` (the default) it forks its workers from a zygote process that imported
torch and the worker once (node/zygote.py); they are its own children all the same (it is their
child subreaper), so everything below holds for either way of starting them.

It reports a worker's exit the moment it begins (a thread polls the workers' /proc stat every
`exit_poll_s`, see `exits.py`; one thread blocked in `wait()` per worker reaps it and reports an
exit the poll missed), kills a rank on the controller's `FenceWorker` and confirms once the
process can no longer run, sends signals for fault injection, and answers `BackupFetch` and
`DenseFetch` from workers of other nodes on its own ROUTER socket (the backup: host_backup.py). Its
workers' heartbeat threads beat to it on a loopback ROUTER (`beat_addr`); every
heartbeat_interval_s it sends the controller one `NodeHeartbeat` with each running rank's last
heartbeat and how long ago it heard it (a stopped rank's age grows until the controller's
deadline names it), and relays the controller's `AbortEpoch` to the rank's heartbeat thread. With
`step_results_via="agent"` its workers send their `StepResult`s to it on a loopback PULL socket
(`result_addr`) and it sends the controller one `NodeStepResults` per step for its ranks (gathered
as node/step_gather.py says; resent answers and `StepFailed` go from the rank directly). With
`step_plans_via="agent"` it connects to the controller's plan socket (`WorkerLaunch.plan_addr`)
and relays each `NodeStepPlans` there, as it came (the controller's MAC checked, not sealed
again), to its workers on a loopback PUB socket (`plan_relay_addr`): one send, which ZeroMQ's I/O
thread fans out to every worker of the node, each taking its own plan out. With
read once, copy many (`WorkerLaunch.read_once`) the first ranks it is asked to start wait until it
has read the dense weights into shared memory once, then map them from there. Every
frame in and out carries the cluster key's MAC; a frame without it, undecodable or not of the
socket is dropped and counted (reported to the controller in `AgentAlive`), never raised; the
workers it starts get the key in their environment. It holds a lease on the
controller (node/lease.py): cut off for `lease_s`, it kills its workers itself and registers
again in recover mode. In a controller group (`agent --etcd`) the lease holds while etcd answers,
and a new leader adopts the workers as they run: the agent registers with them and hands them the
new leader's launch on their stdin (`_follow_leader`, `_welcomed`). `elastic-ep serve` runs one in
a thread; `elastic-ep agent` runs one alone. With `auto_recover` it starts a rank that died again
itself (join_mode recover), after a backoff that doubles with every death in a row, up to
`backoff_max_s`.
On shutdown it terminates its workers (SIGTERM, then SIGKILL after `stop_grace_s`) and removes
its backup file; for owners gone without doing so, the next agent that starts on the node
removes theirs (`backup_file.reap_stale_backups`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import msgspec
import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from elastic_ep.parent_death import adopt_orphans
from elastic_ep.wire import (
    CONTROLLER_TO_AGENT,
    FETCH_REQUEST,
    KEY_ENV,
    PLAN_MAX_FRAME_BYTES,
    RELAYED_TO_WORKER,
    WORKER_TO_AGENT,
    WORKER_TO_AGENT_RESULTS,
    ZMQ_HEARTBEAT_IVL_MS,
    ZMQ_HEARTBEAT_TIMEOUT_MS,
    AbortEpoch,
    AgentAlive,
    AgentBye,
    AgentHello,
    AgentShutdown,
    AgentWelcome,
    BackupAssign,
    BackupReady,
    BackupSite,
    ChaosFailed,
    ClusterKey,
    CutLinks,
    FenceWorker,
    HealLinks,
    Heartbeat,
    Inbox,
    LeaseRenew,
    NewLeader,
    NodeHeartbeat,
    RankBeat,
    SessionEnded,
    SignalWorker,
    StartWorker,
    TermFence,
    WorkerArgs,
    WorkerExited,
    WorkerFenced,
    WorkerLaunch,
    WorkerStarted,
    WorkerStartFailed,
    exit_reason,
    rejected_counts,
)
from elastic_ep.wire.pipe import write_message

from .backup_file import reap_stale_backups
from .exits import exit_code, open_stat
from .hardware import HardwareReader
from .host_backup import HostBackup
from .lease import Lease
from .netcut import NetCut, NetCutUnavailable
from .step_gather import StepGather, node_results
from .zygote import WORKER_MODULE, ForkedWorker, Zygote, base_env

logger = logging.getLogger(__name__)
FETCH_MAX_FRAME_BYTES = 1 << 20  # a fetch request is a list of (layer, expert): a bigger frame disconnects its peer
BEAT_MAX_FRAME_BYTES = 4096  # a heartbeat is some 60 bytes
# a StepResult carries the rank's [layers, experts] expert load (119 KB at DeepSeek-V3's size) and its tokens
RESULT_MAX_FRAME_BYTES = 16 << 20
STEP_RESULTS_VIA = ("direct", "agent")
STEP_PLANS_VIA = ("direct", "agent")
WORKER_STARTS = ("fork", "exec")
ZYGOTE_READY_S = 120.0  # how long a new agent waits for its zygote's imports before it registers

@dataclass
class _Child:
    rank_id: int
    proc: subprocess.Popen | ForkedWorker
    started_at: float
    stat_fd: int
    fencing: bool = False
    final: bool = False
    reported: bool = False
    beat: Heartbeat | None = None  # its last heartbeat
    beat_at: float = 0.0  # when it was read (monotonic)


class NodeAgent:
    """controller_addr: the controller's health socket (tcp://host:port); node: this failure
    domain's name; advertise_host: this host's address: other nodes reach this agent's backup
    there, and its workers bind their data plane to it; lease_s: how long its ranks run without
    word from the controller; num_ranks: how many ranks this node offers (the controller
    assigns their rank_ids);
    join_mode: "recover" for a replacement node that takes over ranks that are down;
    auto_recover: restart dead ranks here, `backoff_s` after the first death, doubling up to
    `backoff_max_s`; a rank that ran `backoff_reset_s` before dying starts the count again;
    exit_poll_s: how often the workers' /proc stat is read for an exit that has begun;
    key: the deployment's cluster key (its workers get it in $ELASTIC_EP_CLUSTER_KEY);
    leader_watch: in a controller group (`agent --etcd`), the group's `LeaderWatch` (group/leader_watch.py),
    whose thread this agent runs: it follows the leader there with its running workers (see
    `_follow_leader`), and its lease fences the node only when neither the controller nor the group
    (etcd) answered for lease_s: losing only the leader never kills a worker;
    step_results_via: "agent" gathers its workers' step results into one `NodeStepResults` per step,
    "direct" has each worker send its own to the controller. A result lost with this agent (it died
    or stalled) is one the controller asks the rank for again past its result deadline
    (`ResendResult`, answered directly);
    step_plans_via: "agent" relays the controller's `NodeStepPlans` for this node to its workers,
    "direct" leaves every plan to the step socket. A plan lost with this agent is a step its rank
    never ran: asked for past the result deadline, the rank answers NOT_RUN and the step is run
    again; a plan that arrives after that is never run (runtime/plan_order.py)."""

    def __init__(
        self,
        controller_addr: str,
        node: str,
        key: ClusterKey,
        advertise_host: str = "127.0.0.1",
        num_ranks: int = 0,
        stop_grace_s: float = 3.0,
        join_mode: str = "initial",
        auto_recover: bool = False,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        backoff_reset_s: float = 60.0,
        lease_s: float = 5.0,
        exit_poll_s: float = 0.005,
        standalone: bool = False,
        hardware_interval_s: float = 1.0,
        leader_watch=None,
        step_results_via: str = "direct",
        step_plans_via: str = "direct",
        worker_start: str = "fork",
        zygote: Zygote | None = None,
    ):
        if step_results_via not in STEP_RESULTS_VIA:
            raise ValueError(f"step_results_via {step_results_via!r} is not one of {', '.join(STEP_RESULTS_VIA)}")
        if step_plans_via not in STEP_PLANS_VIA:
            raise ValueError(f"step_plans_via {step_plans_via!r} is not one of {', '.join(STEP_PLANS_VIA)}")
        if worker_start not in WORKER_STARTS:
            raise ValueError(f"worker_start {worker_start!r} is not one of {', '.join(WORKER_STARTS)}")
        self.worker_start = worker_start
        self.zygote = zygote  # one its command started early (`_first_zygote`), or None
        self.node = node
        self.key = key
        self.fence = TermFence()  # the highest controller term seen: an older leader's frames are dropped
        self.inbox = Inbox("agent", CONTROLLER_TO_AGENT, key, node, self.fence)
        self.fetch_inbox = Inbox("agent_fetch", FETCH_REQUEST, key, node)
        # no term fence on beats: a worker seals with the highest term it has seen, which lags the
        # agent's just after a takeover; as at the controller, what comes up is not a leader's order
        self.beat_inbox = Inbox("agent_beats", WORKER_TO_AGENT, key, node)
        self.standalone = standalone
        self.netcut = NetCut(str(os.getpid()))
        self.heal_at: dict[int | None, float] = {}  # cut rank (None: node) -> when it heals
        if standalone:  # before any socket: a node cut then covers the agent too
            try:
                self.netcut.place("agent", os.getpid())
            except NetCutUnavailable as e:
                logger.warning("node %s: a cut of the whole node would miss its agent: %s", node, e)
        self.host = advertise_host
        self.lease = Lease(lease_s)
        self.stop_grace_s = stop_grace_s
        self.num_ranks = num_ranks
        self.join_mode = join_mode
        self.auto_recover = auto_recover
        self.backoff_s, self.backoff_max_s, self.backoff_reset_s = backoff_s, backoff_max_s, backoff_reset_s
        self.exit_poll_s = exit_poll_s
        self.deaths: dict[int, int] = {}
        self.restart_at: dict[int, float] = {}
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"a{node}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        # notice a connection that died silently (a cut link) and connect again once it heals
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        self.controller_link = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(controller_addr)
        self.controller_addr = controller_addr
        self.leader_watch = leader_watch
        self.leader_term = leader_watch.leader.term if leader_watch and leader_watch.leader else 0
        self.fetch = self.ctx.socket(zmq.ROUTER)
        self.fetch.setsockopt(zmq.LINGER, 0)
        self.fetch.setsockopt(zmq.MAXMSGSIZE, FETCH_MAX_FRAME_BYTES)
        port = self.fetch.bind_to_random_port(f"tcp://{advertise_host}")
        self.fetch_addr = f"tcp://{advertise_host}:{port}"
        # loopback TCP, not ipc: a cut of a rank's links (netcut: its cgroup's packets) silences its beats here too
        self.beats = self.ctx.socket(zmq.ROUTER)
        self.beats.setsockopt(zmq.LINGER, 0)
        self.beats.setsockopt(zmq.MAXMSGSIZE, BEAT_MAX_FRAME_BYTES)
        self.beat_addr = f"tcp://127.0.0.1:{self.beats.bind_to_random_port('tcp://127.0.0.1')}"
        self._node_beat_at = 0.0
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.setsockopt(zmq.MAXMSGSIZE, RESULT_MAX_FRAME_BYTES)
        self.result_addr = "" if step_results_via == "direct" else \
            f"tcp://127.0.0.1:{self.results.bind_to_random_port('tcp://127.0.0.1')}"
        self.result_inbox = Inbox("agent_results", WORKER_TO_AGENT_RESULTS, key, node)
        self.gather = StepGather()
        # --step-plans-via agent: the node's plans from the controller (connected once welcomed, to the
        # launch's plan socket) and relayed to the workers as they came
        self.relays_plans = step_plans_via == "agent"
        self.plan_link = self.ctx.socket(zmq.DEALER)
        self.plan_link.setsockopt(zmq.IDENTITY, f"p{node}".encode())
        self.plan_link.setsockopt(zmq.LINGER, 0)
        self.plan_link.setsockopt(zmq.MAXMSGSIZE, PLAN_MAX_FRAME_BYTES)
        self.plan_link.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        self.plan_link.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        self.plan_link_addr = ""
        self.plan_inbox = Inbox("agent_plans", RELAYED_TO_WORKER, key, node, self.fence)
        self.plan_relay = self.ctx.socket(zmq.PUB)
        self.plan_relay.setsockopt(zmq.LINGER, 0)
        self.plan_relay_addr = f"tcp://127.0.0.1:{self.plan_relay.bind_to_random_port('tcp://127.0.0.1')}" \
            if self.relays_plans else ""
        self._events_addr = f"inproc://agent-events-{id(self)}"
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(self._events_addr)
        self.children: dict[int, _Child] = {}
        self.local_index: dict[int, int] = {}  # rank -> its place among this node's ranks
        self.launch: WorkerLaunch | None = None
        self.backup = HostBackup(node, self.fetch_addr)
        self._awaiting_dense: list[StartWorker] = []  # first starts held until the dense weights are staged
        self._staging: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.hardware_interval_s = hardware_interval_s
        self.hardware: HardwareReader | None = None
        self._hardware_at = 0.0
        self._backup_pieces: list[BackupReady] = []  # announced to the leader; again to a new one that adopts

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until AgentShutdown or `stop` is set; then stop every worker."""
        stop = stop or threading.Event()
        for path in reap_stale_backups():
            logger.warning("node %s: removed %s, the backup file of an owner that is gone", self.node, path)
        self._first_zygote(stop)
        poller = zmq.Poller()
        for s in (self.sock, self.fetch, self.events, self.controller_link, self.beats, self.results, self.plan_link):
            poller.register(s, zmq.POLLIN)
        self.hardware = HardwareReader()
        threading.Thread(target=self._watch_exits, name="exit-watch", daemon=True).start()
        if self.leader_watch is not None:
            threading.Thread(target=self.leader_watch.run, args=(stop,), name="leader-watch", daemon=True).start()
        try:
            while not stop.is_set():
                self._follow_leader()
                self._keep_lease(time.monotonic())
                self._report_hardware(time.monotonic())
                self._heal_due(time.monotonic())
                gather_s = self.gather.next_due_s(time.monotonic())
                ready = dict(poller.poll(20 if gather_s is None else min(20, gather_s * 1000)))
                if self.plan_link in ready:  # first: every rank of the node waits on it
                    self._relay_plans()
                if self.results in ready or gather_s is not None:
                    self._forward_results()
                if self.controller_link in ready and recv_monitor_message(self.controller_link)["event"] \
                        == zmq.EVENT_DISCONNECTED and self.leader_watch is None:  # a group's next leader adopts it
                    self._drop_backup("the controller closed its connection (it stopped or died)", warn=True)
                if self.events in ready:
                    self.sock.send_multipart(self.events.recv_multipart())
                if self.fetch in ready:
                    self._answer_fetch()
                if self.beats in ready:  # all of them before a node heartbeat: its ages are those of now
                    self._read_beats()
                self._send_node_beat(time.monotonic())
                if self.sock in ready:
                    msg = self.inbox.read(self.sock.recv_multipart(copy=False))
                    if msg is not None and not self._carry_out(msg):
                        break
                self._restart_due()
                self._start_staged()
        finally:
            self.shutdown()

    def _follow_leader(self) -> None:
        """In a group: a leader of a higher term than the one this agent follows takes it over. The
        agent connects to it and registers there again under a new session, naming the workers it
        runs (join_mode adopt): they keep running. Once welcomed, it hands them the new leader's
        launch (`NewLeader` on their stdin) and announces its backup again (`_welcomed`)."""
        found = self.leader_watch.leader if self.leader_watch is not None else None
        if found is None or found.term <= self.leader_term:
            return
        running = self._running()
        logger.info("node %s: following the leader %s (term %d) at %s with its %d running ranks", self.node,
                    found.name, found.term, found.controller, len(running))
        if found.controller != self.controller_addr:
            self.sock.disconnect(self.controller_addr)
            self.sock.connect(found.controller)
            self.controller_addr = found.controller
        self.leader_term = found.term
        self.join_mode = "adopt" if running else "initial"
        self.lease.restart()

    def _running(self) -> list[tuple[int, int]]:
        """(rank_id, pid) of the workers that run and are not being fenced."""
        with self._lock:
            return sorted((c.rank_id, c.proc.pid) for c in self.children.values() if not c.fencing and not c.reported)

    def _welcomed(self) -> None:
        """A new leader welcomed this node's adopting session: its workers follow it, and the backup this
        node holds is announced to it again (its pieces with their reference checksums)."""
        assert self.launch is not None
        frames = self.key.seal(NewLeader(self.launch), self.fence.highest)
        with self._lock:
            children = [c for c in self.children.values() if not c.fencing and not c.reported]
        for child in children:
            try:
                write_message(child.proc.stdin, frames)
            except (OSError, ValueError):  # it is exiting (its pipe closed): its exit is reported as usual
                continue
        if self.backup.path is not None:
            for piece in self._backup_pieces:
                self.send(msgspec.structs.replace(piece, session=self.lease.session))

    def _keep_lease(self, now: float) -> None:
        """Register until welcomed, say alive while welcomed, fence this node when the lease ran out (in
        a group: and etcd did not answer either for as long, so the node is cut off from the group;
        a node that reaches etcd waits for the next leader with its workers running)."""
        if self.lease.expired(now) and not (self.leader_watch is not None
                                            and self.leader_watch.group_reached_within(self.lease.lease_s)):
            self._fence_node(f"no word from the controller for {self.lease.lease_s:g}s (--lease-s)")
        if self.lease.hello_due(now):
            self.send(AgentHello(
                self.node, os.getpid(), self.fetch_addr, psutil.virtual_memory().available, self.num_ranks,
                self.join_mode, self.auto_recover, self.lease.session, self.host, self.standalone,
                self._running() if self.join_mode == "adopt" else []))
        if self.lease.alive_due(now, self.launch.heartbeat_interval_s if self.launch is not None else 0.0):
            self.send(AgentAlive(self.node, self.lease.session, self._rejected(), self.backup.storage_bytes,
                                 self._zygote_state()))

    def _read_beats(self) -> None:
        """Every heartbeat waiting on the beat socket: kept on the child of its pid (one that is not
        this agent's running child, e.g. an old process of the rank, is dropped)."""
        while True:
            try:
                _, *frames = self.beats.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            beat = self.beat_inbox.read(frames)
            if beat is None:
                continue
            child = self.children.get(beat.pid)
            if child is not None and child.rank_id == beat.rank_id:
                child.beat, child.beat_at = beat, time.monotonic()

    def _forward_results(self) -> None:
        """Every step result waiting on the result socket into the gather (one not of a running child of
        this agent is dropped), then each step's that is due to the controller in one `NodeStepResults`."""
        running = {rank_id for rank_id, _ in self._running()}
        while True:
            try:
                frames = self.results.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            result = self.result_inbox.read(frames)
            if result is not None and result.rank_id in running:
                self.gather.add(result, time.monotonic())
        for results in self.gather.due(time.monotonic(), running):
            self.send(node_results(self.node, self.lease.session, results))

    def _relay_plans(self) -> None:
        """Every node plan waiting on the plan link to the workers, as it came; a frame without the
        cluster key's MAC, or of a deposed controller's term, is dropped (and counted) here."""
        while True:
            try:
                frames = self.plan_link.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self.plan_inbox.admit(frames) is not None:
                self.plan_relay.send_multipart(frames, copy=False)

    def _link_plans(self, launch: WorkerLaunch) -> None:
        """Connect the plan link to the plan socket of the controller `launch` names (a new leader's,
        a rolling restart's launch), once it differs from the one connected."""
        if not self.relays_plans or not launch.plan_addr or launch.plan_addr == self.plan_link_addr:
            return
        if self.plan_link_addr:
            self.plan_link.disconnect(self.plan_link_addr)
        self.plan_link.connect(launch.plan_addr)
        self.plan_link_addr = launch.plan_addr

    def _send_node_beat(self, now: float) -> None:
        """Every heartbeat_interval_s while welcomed: one `NodeHeartbeat` with the last heartbeat of
        every running rank heard from and its age (a stopped rank's grows: the controller's deadline
        names it as if it had heard nothing)."""
        launch = self.launch
        if launch is None or launch.heartbeat_interval_s <= 0 or not self.lease.welcomed \
                or now - self._node_beat_at < launch.heartbeat_interval_s:
            return
        self._node_beat_at = now
        self._read_beats()  # whatever came since the last poll (after a stall of this process, all of it)
        now = time.monotonic()
        with self._lock:
            heard = [c for c in self.children.values() if c.beat is not None and not c.fencing and not c.reported]
        beats = [RankBeat(c.rank_id, c.proc.pid, c.beat.progress, round(now - c.beat_at, 4)) for c in heard]
        if beats:
            self.send(NodeHeartbeat(self.node, self.lease.session, beats))
            self.lease.node_beat_sent(now)

    def _relay_abort(self, msg: AbortEpoch) -> None:
        """The controller's `AbortEpoch` to the heartbeat thread of each rank it names (sealed again
        in the same term, once)."""
        sealed = self.key.seal(msg, self.fence.highest)
        for rank_id in msg.rank_ids:
            self.beats.send_multipart([f"h{rank_id}".encode(), *sealed])

    def send(self, message) -> None:
        """To the controller (main loop thread only; other threads `_notify`)."""
        self.sock.send_multipart(self.key.seal(message, self.fence.highest))

    def _rejected(self) -> list[tuple[str, str, int]]:
        """(socket, reason, frames) this agent dropped, for the controller's /metrics."""
        return [(socket, reason, n) for (socket, node, reason), n in sorted(rejected_counts().items())
                if node == self.node]

    def _report_hardware(self, now: float) -> None:
        """This node's hardware signals every hardware_interval_s while welcomed (node/hardware.py)."""
        if self.hardware is None or not self.lease.welcomed or now - self._hardware_at < self.hardware_interval_s:
            return
        self._hardware_at = now
        self.send(self.hardware.read(self.node))

    def _fence_node(self, why: str) -> None:
        """Kill every worker of this node (no restart) and register again, in recover mode."""
        with self._lock:
            children = list(self.children.values())
            for child in children:
                child.fencing, child.final = True, True
            self.restart_at.clear()
            self._awaiting_dense.clear()
        for child in children:
            self._signal(child.proc.pid, signal.SIGKILL)
        logger.warning("node %s: fenced its %d ranks: %s; registering again", self.node, len(children), why)
        # the controller plans no transfer from this node's backup any more
        self._drop_backup("this node fenced itself")
        self.join_mode = "recover"
        self.lease.restart()

    def _carry_out(self, msg) -> bool:
        """`_handle`, where an error in carrying out one order is logged and the node goes on: its other
        ranks run on, and the controller's deadlines judge what did not happen (a fence not confirmed).
        Before, the error ended this thread and so every rank of the node."""
        try:
            return self._handle(msg)
        except Exception:
            logger.exception("node %s: could not carry out %s; the node goes on", self.node, type(msg).__name__)
            return True

    def _handle(self, msg) -> bool:
        now = time.monotonic()
        if isinstance(msg, AgentWelcome):
            again = self.lease.welcomed  # a welcome repeated for a repeated hello
            if self.lease.welcome(msg.session, now):
                self.launch = msg.launch
                self._link_plans(msg.launch)
                if self.join_mode == "adopt" and not again:
                    self._welcomed()
            return True
        if isinstance(msg, LeaseRenew):
            self.lease.renew(msg.session, now)
            return True
        if isinstance(msg, SessionEnded):
            if msg.session == self.lease.session:
                self._fence_node(f"the controller ended this session: {msg.reason}")
            return True
        if isinstance(msg, AgentShutdown):
            return False
        if not self.lease.welcomed:  # an order to a session that ended
            return True
        if isinstance(msg, BackupAssign):
            assert self.launch is not None
            if self.backup.path is not None:
                self._drop_backup("the controller assigned a new share")
            threading.Thread(target=self.backup.build,
                             args=(self.launch, msg.items, msg.device_kind, self._announce, self._stopped),
                             daemon=True).start()
        elif isinstance(msg, StartWorker):
            with self._lock:
                self.restart_at.pop(msg.rank_id, None)
            if msg.launch is not None:
                self.launch = msg.launch
                self._link_plans(msg.launch)
            if not self._await_dense(msg):
                self._start(msg.rank_id, msg.join_mode, msg.dense_site)
        elif isinstance(msg, FenceWorker):
            self._fence(msg)
        elif isinstance(msg, SignalWorker):
            self._signal(msg.pid, msg.signal)
        elif isinstance(msg, CutLinks | HealLinks):
            self._cut(msg)
        elif isinstance(msg, AbortEpoch):
            self._relay_abort(msg)
        return True

    def _cut(self, msg: CutLinks | HealLinks) -> None:
        """Fault injection: cut (or heal) a rank's links, or the whole node's."""
        name = None if msg.rank_id is None else f"rank{msg.rank_id}"
        try:
            if isinstance(msg, HealLinks):
                self.netcut.heal(name)
                self.heal_at.pop(msg.rank_id, None)
                return
            if name is None and not self.standalone:
                raise NetCutUnavailable(f"node {self.node} runs inside `elastic-ep serve` with the controller; cut "
                                        "its ranks, or run the node as `elastic-ep agent`")
            self.netcut.cut(name)
        except NetCutUnavailable as e:
            self.send(ChaosFailed(self.node, str(e)))
            return
        logger.warning("node %s: cut the links of %s for %ss", self.node, name or "the node", msg.duration_s or "ever")
        if msg.duration_s > 0:
            self.heal_at[msg.rank_id] = time.monotonic() + msg.duration_s

    def _heal_due(self, now: float) -> None:
        for rank_id in [r for r, t in self.heal_at.items() if t <= now]:
            del self.heal_at[rank_id]
            self.netcut.heal(None if rank_id is None else f"rank{rank_id}")
            logger.warning("node %s: healed the links of %s", self.node, "the node" if rank_id is None else
                           f"rank {rank_id}")

    def _announce(self, piece: BackupReady) -> None:
        """A piece of the backup is written (the build's thread): kept, and reported in this agent's
        session of now."""
        piece = msgspec.structs.replace(piece, session=self.lease.session)
        self._backup_pieces.append(piece)
        self._notify(piece)

    def _drop_backup(self, why: str, warn: bool = False) -> None:
        self._backup_pieces = []
        self.backup.drop(why, warn=warn)

    def _notify(self, message) -> None:
        """Queue a report to the controller from any thread (each gets its own PUSH socket)."""
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(self._events_addr)
        push.send_multipart(self.key.seal(message, self.fence.highest))
        push.close()

    def _start(self, rank_id: int, join_mode: str, dense_site: BackupSite | None = None) -> None:
        assert self.launch is not None, "StartWorker before AgentWelcome"
        local = dense_site is not None and dense_site.node == self.node
        args = WorkerArgs(self.launch, rank_id, self.node, self.host, self._local_index(rank_id), join_mode,
                          dense_path=dense_site.path if dense_site is not None and local else "",
                          dense_addr=dense_site.fetch_addr if dense_site is not None and not local else "",
                          beat_addr=self.beat_addr, result_addr=self.result_addr,
                          plan_relay_addr=self.plan_relay_addr)
        try:
            proc = self._launch(args)
        except OSError as e:  # the fork or exec refused (memory, the node's process limit): one failed start
            reason = f"{e.strerror or e} ({type(e).__name__})"
            logger.warning("node %s: could not start rank %d: %s", self.node, rank_id, reason)
            self.send(WorkerStartFailed(self.node, rank_id, reason, self.lease.session))
            if self.auto_recover:
                with self._lock:
                    self._restart_later(rank_id, ran_s=0.0)
            return
        # in its own cgroup long before it opens a socket (it imports torch first), so it can be cut
        try:
            self.netcut.place(f"rank{rank_id}", proc.pid)
        except NetCutUnavailable as e:
            logger.warning("node %s: rank %d runs, but its links cannot be cut: %s", self.node, rank_id, e)
        if isinstance(proc, ForkedWorker):
            proc.release()
        with self._lock:
            self.children[proc.pid] = _Child(rank_id, proc, time.monotonic(), open_stat(proc.pid))
        threading.Thread(target=self._wait, args=(proc.pid,), daemon=True).start()
        started_by = "fork" if isinstance(proc, ForkedWorker) else "exec"
        self.send(WorkerStarted(self.node, rank_id, proc.pid, self.lease.session, started_by))
        logger.info("node %s: started rank %d (pid %d, %s, by %s)", self.node, rank_id, proc.pid, join_mode, started_by)

    def _first_zygote(self, stop: threading.Event) -> None:
        """--worker-start fork: this agent's zygote (the one its command started before importing torch
        itself, else a new one), waited for (at most ZYGOTE_READY_S) before the agent registers: its
        first ranks then fork from it instead of each importing torch."""
        if self.worker_start == "fork" and not adopt_orphans():
            logger.warning("node %s: this kernel does not let the agent adopt its forked workers "
                           "(PR_SET_CHILD_SUBREAPER); its ranks start by exec", self.node)
            self.worker_start = "exec"
        if self.worker_start != "fork":
            if self.zygote is not None:
                self.zygote.close()
                self.zygote = None
            return
        if self.zygote is None or not self.zygote.alive:
            self._spawn_zygote()
        if self.zygote is not None and not self.zygote.wait_ready(ZYGOTE_READY_S, stop) and not stop.is_set():
            logger.warning("node %s: the worker zygote was not ready in %gs; ranks start by exec until it is",
                           self.node, ZYGOTE_READY_S)

    def _zygote_state(self) -> str:
        """How the next rank would start, for `AgentAlive` (wire/codec.py `ZygoteState`)."""
        if self.worker_start != "fork":
            return "off"
        if self.zygote is None or not self.zygote.alive:
            return "down"
        return "ready" if self.zygote.ready else "starting"

    def _spawn_zygote(self) -> None:
        """A new zygote (the one before, if any, closed): its imports run in its own process."""
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        try:
            self.zygote = Zygote()
        except OSError as e:
            logger.warning("node %s: could not start the worker zygote (%s); ranks start by exec", self.node, e)

    def _launch(self, args: WorkerArgs) -> subprocess.Popen | ForkedWorker:
        """The rank's process, its stdin the agent link (`NewLeader` when the controller group's
        leader changes): forked from the zygote (held until `release`) when it is ready and the
        code on disk is what it imported, else started by exec (with --worker-start fork a new zygote
        is started for the next start when this one died or its code is stale). Raises OSError when
        the kernel refuses the process."""
        zygote, key_env = self.zygote, {KEY_ENV: self.key.hex()}
        fresh = zygote is not None and zygote.fresh  # a walk of the package's files: once a start
        if zygote is not None and zygote.ready:
            if fresh:
                try:
                    return zygote.fork(f"{WORKER_MODULE}:main", [args.to_json()], args.title(), key_env)
                except ConnectionError as e:
                    logger.warning("node %s: the worker zygote failed (%s); rank %d starts by exec", self.node, e,
                                   args.rank_id)
            else:
                logger.info("node %s: the code changed on disk since the worker zygote imported it; rank %d "
                            "starts by exec and a new zygote imports it", self.node, args.rank_id)
        if self.worker_start == "fork" and (zygote is None or not zygote.alive or not fresh):
            self._spawn_zygote()
        return subprocess.Popen([sys.executable, "-m", WORKER_MODULE, args.to_json()],
                                env={**base_env(), **key_env}, stdin=subprocess.PIPE)

    def _await_dense(self, msg: StartWorker) -> bool:
        """Read once, copy many: hold a start that would read the dense weights from disk until
        this agent has staged them in shared memory (the first start). Whether it is held."""
        assert self.launch is not None
        if not self.launch.read_once or msg.dense_site is not None or self.backup.site() is not None:
            return False
        self._awaiting_dense.append(msg)
        if self._staging is None:
            self._staging = threading.Thread(target=self._stage_dense, name="stage-dense", daemon=True)
            self._staging.start()
        return True

    def _stage_dense(self) -> None:
        assert self.launch is not None
        try:
            self.backup.stage_dense(self.launch)
        except Exception as e:  # the ranks then read the checkpoint themselves
            logger.warning("node %s: could not stage the dense weights in shared memory (%s: %s); its ranks read "
                           "them from disk", self.node, type(e).__name__, e)

    def _start_staged(self) -> None:
        """Start the held ranks once the dense weights are staged (or staging failed: from disk)."""
        if not self._awaiting_dense or self._staging is None or self._staging.is_alive():
            return
        held, self._awaiting_dense = self._awaiting_dense, []
        for msg in held:
            self._start(msg.rank_id, msg.join_mode, self.backup.site())

    def _local_index(self, rank_id: int) -> int:
        """The rank's place among this node's ranks (its GPU): the one it had, else the lowest free."""
        with self._lock:
            running = {c.rank_id for c in self.children.values()} - {rank_id}
            taken = {self.local_index[r] for r in running if r in self.local_index}
            index = self.local_index.get(rank_id)
            if index is None or index in taken:
                index = min(set(range(len(taken) + 1)) - taken)
            self.local_index[rank_id] = index
        return index

    def _watch_exits(self) -> None:
        while not self._stopped.wait(self.exit_poll_s):
            # read under the lock `_wait` closes a reaped worker's descriptor under (after reporting it):
            # a descriptor closed, or its number reused by another file, is never read
            with self._lock:
                exited = [(c, code) for c in self.children.values()
                          if not c.reported and (code := exit_code(c.stat_fd)) is not None]
            for child, code in exited:
                self._report_exit(child, code)

    def _report_exit(self, child: _Child, returncode: int) -> None:
        """Report a worker's exit once: to the controller as fenced when it was fenced."""
        with self._lock:
            if child.reported:
                return
            child.reported = True
        if child.fencing:
            self._notify(WorkerFenced(self.node, child.rank_id, child.proc.pid))
        else:
            self._notify(WorkerExited(self.node, child.rank_id, child.proc.pid, returncode))

    def _wait(self, pid: int) -> None:
        child = self.children[pid]
        returncode = child.proc.wait()
        self._report_exit(child, returncode)
        with self._lock:  # see `_watch_exits`
            os.close(child.stat_fd)
        child.proc.stdin.close()
        self.netcut.remove(f"rank{child.rank_id}")
        with self._lock:
            self.children.pop(pid, None)
            if self.auto_recover and returncode != 0 and not child.final and not self._stopped.is_set():
                self._restart_later(child.rank_id, time.monotonic() - child.started_at)
        logger.log(logging.INFO if child.fencing or returncode == 0 else logging.WARNING,
                   "node %s: rank %d (pid %d) %s: %s", self.node, child.rank_id, pid,
                   "fenced" if child.fencing else "ended", exit_reason(returncode))

    def _restart_later(self, rank_id: int, ran_s: float) -> None:
        """Auto-recover: start the rank again after a backoff that doubles with each death (or failed
        start) in a row, a run of `backoff_reset_s` ending the row. Called under `_lock`."""
        deaths = 0 if ran_s >= self.backoff_reset_s else self.deaths.get(rank_id, 0)
        self.deaths[rank_id] = deaths + 1
        self.restart_at[rank_id] = time.monotonic() + min(self.backoff_s * 2**deaths, self.backoff_max_s)

    def _fence(self, msg: FenceWorker) -> None:
        with self._lock:
            child = self.children.get(msg.pid)
            if child is not None:
                child.fencing, child.final = True, msg.final
        if child is None:
            self.send(WorkerFenced(self.node, msg.rank_id, msg.pid))
            return
        self._signal(msg.pid, signal.SIGKILL)

    def _restart_due(self) -> None:
        """Start the ranks whose backoff has run out (auto_recover), dense weights from this node's backup."""
        if not self.lease.welcomed:
            return
        now = time.monotonic()
        with self._lock:
            due = [r for r, t in self.restart_at.items() if t <= now]
            for r in due:
                del self.restart_at[r]
        site = self.backup.site()
        for rank_id in due:
            self._start(rank_id, "recover", site)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _answer_fetch(self) -> None:
        """One request of the fetch socket (REQ envelope: sender, empty frame); a dropped frame gets no answer."""
        sender, *frames = self.fetch.recv_multipart(copy=False)
        if len(frames) < 1 or frames[0].bytes != b"":
            self.fetch_inbox.read(frames)  # not a REQ envelope: counted as such
            return
        msg = self.fetch_inbox.read(frames[1:])
        if msg is not None:
            self.fetch.send_multipart([sender.bytes, b"", *self.key.seal(self.backup.answer(msg))])

    def shutdown(self) -> None:
        """Stop every worker (SIGTERM, SIGKILL after stop_grace_s) and remove the backup file."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.hardware is not None:
            self.hardware.close()
        if self.zygote is not None:
            self.zygote.close()
        with self._lock:
            procs = [c.proc for c in self.children.values()]
        for p in procs:
            self._signal(p.pid, signal.SIGCONT)
            self._signal(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self._signal(p.pid, signal.SIGKILL)
                p.wait()
        self._drop_backup("the agent stopped")
        self.netcut.close()
        self.send(AgentBye(self.node, self.lease.session))
        self.sock.disable_monitor()
        for s in (self.sock, self.fetch, self.events, self.controller_link, self.beats, self.results, self.plan_link,
                  self.plan_relay):
            s.close()
