"""Heartbeats (a worker's heartbeat thread -> its node's agent, on the agent's beat socket; the
agent -> the controller, one `NodeHeartbeat` per interval for all its ranks), step results gathered
per node (`agent --step-results-via agent`: a worker's `StepResult` -> its agent's result socket;
the agent -> the controller, one `NodeStepResults` per step for its ranks) and node agents <->
the controller, on the controller's health socket."""

from __future__ import annotations

import math
import signal

import numpy as np

from elastic_ep.model.sampling import TokenLogprobs

from .codec import Count, JoinMode, Message, Pid, RankId, Record, StartedBy, ZygoteState
from .fetch import BackupSite
from .worker import WorkerLaunch


class Progress(Record):
    """Where a worker's main thread is: `seq` counts collectives entered in this epoch;
    phase: idle, compute, dispatch, combine, transfer or rendezvous; `since`: the worker's wall
    clock at entry (for display; the controller times lags with its own clock)."""

    epoch: int = -1
    step: int = -1
    layer: int = -1
    phase: str = "idle"
    seq: int = 0
    since: float = 0.0


class Heartbeat(Message):
    """A worker's heartbeat thread -> its agent (loopback), every heartbeat_interval_s."""

    rank_id: int
    pid: int
    progress: Progress


class RankBeat(Record):
    """One rank in a `NodeHeartbeat`: its last heartbeat as the agent heard it, `age_s` seconds
    before the agent sent the node's message (the agent's clock)."""

    rank_id: int
    pid: int
    progress: Progress
    age_s: float


class NodeHeartbeat(Message):
    """An agent -> the controller, every heartbeat_interval_s: the last heartbeat of each of its
    running ranks it has heard from (a stopped rank stays in it, its age growing). The controller
    takes each as that rank's heartbeat heard at arrival - age_s."""

    node: str
    session: str
    beats: list[RankBeat]


class NodeStepResults(Message):
    """An agent -> the controller: its ranks' results of one step (`epoch`, `step`), as many as
    answered within the agent's gather window (node/step_gather.py); the rest follow in later ones.
    The controller takes each rank's as if that rank had sent its `StepResult`.

    Columnar, so that the controller reads a node's step without an object per rank: every per-rank
    list has one entry per rank of `rank_ids`, in its order; `wait_s` is the rank's dispatch and
    combine wait together; rank i's sampled tokens are the `token_counts[i]` (seq_id, token) pairs of
    `seq_ids`/`tokens` after those of the ranks before it. What few ranks have (logprobs, errors, an
    expert load report) is keyed by rank, only for those that have it. A frame whose lists disagree
    in length, that names a rank twice or keys a rank it does not list, or has a time that is
    negative or not finite, fails to decode: it is dropped and counted (wire/codec.py)."""

    node: str
    session: str
    epoch: int
    step: int
    rank_ids: list[int]
    step_s: list[float]
    compute_s: list[float]
    wait_s: list[float]
    slot_tokens: list[int]
    shape: list[int]
    remote_messages: list[int]
    remote_bytes: list[int]
    kv_move_s: list[float]
    token_counts: list[int]
    seq_ids: list[int]
    tokens: list[int]
    logprobs: dict[int, dict[int, TokenLogprobs]] = {}  # rank -> seq_id -> the sampled token's logprobs
    errors: dict[int, dict[int, str]] = {}  # rank -> seq_id -> why its token could not be sampled
    expert_load: dict[int, np.ndarray] = {}  # rank -> [L, E] int32, for the ranks that reported one

    def __post_init__(self) -> None:
        n = len(self.rank_ids)
        if any(len(column) != n for column in (self.step_s, self.compute_s, self.wait_s, self.slot_tokens, self.shape,
                                               self.remote_messages, self.remote_bytes, self.kv_move_s,
                                               self.token_counts)):
            raise ValueError(f"every per-rank list needs one entry for each of the {n} ranks")
        if len(set(self.rank_ids)) != n:
            raise ValueError("a rank is listed twice")
        if any(c < 0 for c in self.token_counts) or len(self.seq_ids) != sum(self.token_counts) \
                or len(self.tokens) != len(self.seq_ids):
            raise ValueError("token_counts must count the (seq_id, token) pairs of each rank")
        for column in (self.step_s, self.compute_s, self.wait_s, self.kv_move_s):
            if not all(map(math.isfinite, column)) or min(column, default=0.0) < 0:
                raise ValueError("a time is negative or not finite")
        listed = set(self.rank_ids)
        if not (self.logprobs.keys() | self.errors.keys() | self.expert_load.keys()) <= listed:
            raise ValueError("logprobs, errors or an expert load of a rank not listed")
        if any(load.ndim != 2 for load in self.expert_load.values()):
            raise ValueError("an expert load is [layers, experts]")


class AbortEpoch(Message):
    """Controller -> a node's agent -> the heartbeat thread of each of `rank_ids` (that node's
    ranks; the agent seals it once and relays it to each): the controller gave up on `epoch`; any
    collective of it that waits (on a peer that is hung or cut off) gives up now. One frame a node,
    not one a rank: a fence at 1,024 ranks sent 1,023."""

    epoch: int
    rank_ids: list[int] = []


# ---- agent <-> controller, health socket ---------------------------------------------------

# An agent not yet welcomed repeats its `AgentHello` this often (node/lease.py); until its first
# `AgentAlive` of the session (it can send none before the welcome reaches it) the controller
# allows it this much silence more than --agent-timeout-s.
AGENT_HELLO_INTERVAL_S = 1.0


class AgentHello(Message):
    """An agent (re)registers; `session` names this registration: every lease renewal and the
    welcome carry it, so nothing from an earlier session (an agent the controller gave up on)
    is mistaken for the current one."""

    node: str
    pid: Pid
    fetch_addr: str
    backup_capacity_bytes: Count
    num_ranks: Count
    join_mode: JoinMode = "initial"  # "recover": a replacement node, it takes over ranks that are down; "adopt": below
    auto_recover: bool = False  # the agent restarts its own dead ranks (the controller does not)
    session: str = ""
    host: str = ""  # the address the agent and its workers advertise (--advertise-host)
    standalone: bool = True  # its own process (`elastic-ep agent`), not a thread of `serve`
    # join_mode "adopt" (a new leader of its group): (rank_id, pid) of the workers it runs, kept for adoption
    running: list[tuple[RankId, Pid]] = []


class AgentWelcome(Message):
    """What the agent needs to start workers (each gets it inside its `WorkerArgs`); the first
    lease of `session` starts now."""

    launch: WorkerLaunch
    session: str = ""


class AgentAlive(Message):
    """Every lease_s / 4 an agent says it is alive; the controller answers `LeaseRenew`.
    `frames_rejected`: (socket, reason, frames) its sockets dropped since it started (wire/codec.py)."""

    node: str
    session: str
    frames_rejected: list[tuple[str, str, int]] = []
    storage_bytes: int = 0  # read from the checkpoint by the agent since it started (its backup, the dense stage)
    zygote: ZygoteState = "off"  # how its next rank would start (wire/codec.py)


class LeaseRenew(Message):
    """The controller heard the agent of `session`: its lease runs for another `lease_s`."""

    session: str
    lease_s: float


class SessionEnded(Message):
    """The controller gave up on this agent session (it was unreachable): the agent kills its
    workers, as an expired lease would, and registers again in recover mode."""

    session: str
    reason: str


class BackupAssign(Message):
    """Keep these (MoE layer index, expert) in this node's host-memory backup; answer BackupReady
    with the checksum of each expert as read from the checkpoint, of the kind the ranks take on
    `device_kind` ("cpu" or an accelerator's, runtime/experts.py: expert_checksum)."""

    items: list[tuple[int, int]]
    device_kind: str = "cpu"


class StartWorker(Message):
    """Start a rank; `dense_site`: an agent holding the dense weights in host memory (None: disk);
    `launch`: what this worker and every later one of the agent starts with, replacing the
    welcome's (a rolling restart's new options); None: keep the agent's."""

    rank_id: int
    join_mode: str
    dense_site: BackupSite | None = None
    launch: WorkerLaunch | None = None


class WorkerStarted(Message):
    """`session`: the agent's, when it started the process; one of a session the controller gave up
    on is not taken (that agent fences its processes itself). `started_by`: exec (a new Python that
    imports everything first) or fork (from the node's zygote, node/zygote.py): the `started` event
    says which, so a slow restart by exec (the zygote not ready, or gone) can be told apart."""

    node: str
    rank_id: RankId
    pid: Pid
    session: str = ""
    started_by: StartedBy = "exec"


class WorkerExited(Message):
    node: str
    rank_id: int
    pid: int
    returncode: int


class WorkerStartFailed(Message):
    """An agent could not start the rank's process (`reason`: the OS's refusal, such as a fork
    refused for memory or by the node's process limit); nothing of it runs. `session`: as in
    `WorkerStarted`."""

    node: str
    rank_id: int
    reason: str
    session: str = ""


class FenceWorker(Message):
    """Kill `pid` (SIGKILL) and answer `WorkerFenced` once it is gone. `final`: the rank leaves
    the cluster (a scale ended), so an agent with --auto-recover does not start it again."""

    rank_id: int
    pid: int
    reason: str
    final: bool = False


class WorkerFenced(Message):
    node: str
    rank_id: int
    pid: int


class SignalWorker(Message):
    """Fault injection: send `signal` (SIGKILL, SIGSTOP, SIGCONT) to `pid`."""

    rank_id: int
    pid: int
    signal: int


class CutLinks(Message):
    """Fault injection: drop every packet of rank `rank_id`'s process (None: of the whole node,
    its agent included), healing by itself after `duration_s` (0: only on HealLinks)."""

    rank_id: int | None
    duration_s: float = 0.0


class HealLinks(Message):
    rank_id: int | None


class ChaosFailed(Message):
    """An agent could not inject a fault: `reason` says why."""

    node: str
    reason: str


class BackupReady(Message):
    """A piece of the node's backup is written: `experts` can be read from `site` from now on.
    Sent once per piece; `share`: experts of the whole share (complete once all were announced);
    `nbytes`: the file's size; `session`: the agent session that announces it (a piece of another
    session, such as a previous agent process's that arrives late, is not taken)."""

    node: str
    site: BackupSite
    experts: list[tuple[int, int]]
    nbytes: int
    share: int = 0
    checksums: list[int] = []  # of each of `experts` as read from the checkpoint (the reference for it)
    session: str = ""


class AgentShutdown(Message):
    pass


class AgentBye(Message):
    """An agent is stopping: its ranks and its backup go with it. `session`: as in `WorkerStarted`
    (the bye of an agent process that stopped, come after its node's next agent registered, is not
    taken for the new one's)."""

    node: str
    session: str = ""


def exit_reason(returncode: int) -> str:
    """How a worker ended, for people, from `WorkerExited.returncode` (Popen's convention:
    -N is killed by signal N): "killed by SIGKILL", "exited with code 2"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"
