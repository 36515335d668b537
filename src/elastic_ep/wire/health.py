"""Heartbeats (worker heartbeat thread -> controller) and node agents <-> the controller, both on
the controller's health socket."""

from __future__ import annotations

from dataclasses import dataclass

from .fetch import BackupSite
from .worker import WorkerLaunch


@dataclass(frozen=True)
class Progress:
    """Where a worker's main thread is: `seq` counts collectives entered in this epoch;
    phase: idle, compute, dispatch, combine, transfer or rendezvous; `since`: the worker's wall
    clock at entry (for display; the controller times lags with its own clock)."""

    epoch: int = -1
    step: int = -1
    layer: int = -1
    phase: str = "idle"
    seq: int = 0
    since: float = 0.0


@dataclass(frozen=True)
class Heartbeat:
    rank_id: int
    pid: int
    progress: Progress


# ---- agent <-> controller, health socket ---------------------------------------------------


@dataclass(frozen=True)
class AgentHello:
    node: str
    pid: int
    fetch_addr: str
    backup_capacity_bytes: int
    num_ranks: int
    join_mode: str = "initial"  # "recover": a replacement node, it takes over ranks that are down
    auto_recover: bool = False  # the agent restarts its own dead ranks (the controller does not)


@dataclass(frozen=True)
class AgentWelcome:
    """What the agent needs to start workers (each gets it inside its `WorkerArgs`)."""

    launch: WorkerLaunch


@dataclass(frozen=True)
class BackupAssign:
    """Keep these (MoE layer index, expert) in this node's host-memory backup; answer BackupReady."""

    items: list[tuple[int, int]]


@dataclass(frozen=True)
class StartWorker:
    """Start a rank; `dense_site`: an agent holding the dense weights in host memory (None: disk)."""

    rank_id: int
    join_mode: str
    dense_site: BackupSite | None = None


@dataclass(frozen=True)
class WorkerStarted:
    node: str
    rank_id: int
    pid: int


@dataclass(frozen=True)
class WorkerExited:
    node: str
    rank_id: int
    pid: int
    returncode: int


@dataclass(frozen=True)
class FenceWorker:
    """Kill `pid` (SIGKILL) and answer `WorkerFenced` once it is gone. `final`: the rank leaves
    the cluster (a scale ended), so an agent with --auto-recover does not start it again."""

    rank_id: int
    pid: int
    reason: str
    final: bool = False


@dataclass(frozen=True)
class WorkerFenced:
    node: str
    rank_id: int
    pid: int


@dataclass(frozen=True)
class SignalWorker:
    """Fault injection: send `signal` (SIGKILL, SIGSTOP, SIGCONT) to `pid`."""

    rank_id: int
    pid: int
    signal: int


@dataclass(frozen=True)
class BackupReady:
    """A piece of the node's backup is written: `experts` can be read from `site` from now on.
    Sent once per piece; `share`: experts of the whole share (complete once all were announced);
    `nbytes`: the file's size."""

    node: str
    site: BackupSite
    experts: list[tuple[int, int]]
    nbytes: int
    share: int = 0


@dataclass(frozen=True)
class AgentShutdown:
    pass


@dataclass(frozen=True)
class AgentBye:
    """An agent is stopping: its ranks and its backup go with it."""

    node: str
