"""Every message that crosses a process boundary on the control plane.

Transport: ZeroMQ. The controller binds two ROUTER sockets:
- the step socket: each worker's main thread (DEALER, identity `w<rank_id>`) receives
  `EpochStart`, `StepPlan`, `Shutdown` and answers `WorkerHello`, `EpochReady`, `EpochFailed`,
  `StepResult`, `StepFailed`;
- the health socket: each worker's heartbeat thread (DEALER, identity `h<rank_id>`) sends
  `Heartbeat`; each node agent (DEALER, identity `a<node>`) sends `AgentHello`,
  `WorkerStarted`, `WorkerExited`, `WorkerFenced` and receives `AgentWelcome`, `BackupAssign`,
  `StartWorker`, `FenceWorker`, `SignalWorker`, `AgentShutdown`, and says `AgentBye` when it stops.
An agent also binds a ROUTER for `BackupFetch` -> `BackupTensors` and `DenseFetch` ->
`DenseTensors` from workers of other nodes.

Frames are pickled dataclasses: the control plane is a trusted cluster-internal network (the
same trust as the TCPStore and the torch.distributed data plane). Every message a worker acts
on carries its epoch; a worker drops a message of an epoch other than its current or next one,
which is what keeps a fenced or late process out of a newer epoch.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes) -> Any:
    return pickle.loads(frame)


# ---- worker <-> controller, step socket -------------------------------------------------


@dataclass(frozen=True)
class WorkerHello:
    """A worker process is up, has its dense weights and waits for an epoch."""

    rank_id: int
    node: str
    pid: int
    join_mode: str  # "initial" | "recover"
    dense_source: str = "disk"  # "host_memory" | "peer" | "disk" (runtime.dense)
    load_s: float = 0.0
    warmup_s: float = 0.0  # the dummy forward it ran before registering (runtime.worker)


@dataclass(frozen=True)
class SlotSource:
    """Where one slot of the receiving rank gets its expert in a new epoch.

    kind: "keep" (already there), "local" (slot `src_slot` of the same rank, old contents),
    "peer" (slot `src_slot` of rank `src_rank`, sent point-to-point in the new group),
    "backup" (the host-memory backup of node `src_node`), "disk" (the checkpoint).
    `slot` and `src_slot` are indices within a rank (0..slots_per_rank-1); `layer` indexes the
    MoE layers (0..L-1), not the model's layer ids.
    """

    layer: int
    slot: int
    expert: int
    kind: str
    src_rank: int = -1
    src_slot: int = -1
    src_node: str = ""


@dataclass(frozen=True)
class BackupSite:
    """A node's expert backup: same-node workers mmap `path`, others ask `fetch_addr`."""

    node: str
    path: str
    fetch_addr: str


@dataclass(frozen=True)
class EpochStart:
    """Form the group of `epoch` with `members` (rank_ids; position = group rank), hold the
    experts of `phy2log` [L, num_ranks * slots_per_rank] and fill each slot as `sources` says.

    `sources` lists, for the receiving rank only, every slot whose contents change, plus
    `sends`: (dst_rank, layer, src_slot) this rank must send to peers, in the order the peer
    expects them.
    """

    epoch: int
    members: list[int]
    phy2log: np.ndarray
    slots_per_rank: int
    sources: list[SlotSource]
    sends: list[tuple[int, int, int]]
    backups: dict[str, BackupSite]
    collective_timeout_s: float
    backup_fetch_timeout_s: float


@dataclass(frozen=True)
class TransferStat:
    source: str
    bytes_moved: int
    seconds: float


@dataclass(frozen=True)
class EpochReady:
    """The rank is in the group of `epoch`, holds its slots and has checked them.

    checksums: (layer, slot) -> checksum of the expert now in that slot (see runtime.experts).
    """

    epoch: int
    rank_id: int
    checksums: dict[tuple[int, int], int]
    transfers: list[TransferStat]
    rendezvous_s: float
    transfer_s: float
    verify_s: float


@dataclass(frozen=True)
class EpochFailed:
    """`unreachable_node`: the node whose expert backup did not answer (its agent is gone)."""

    epoch: int
    rank_id: int
    error: str
    unreachable_node: str = ""


@dataclass(frozen=True)
class ChunkPlan:
    """One sequence's tokens in a step. `sample` is set when this chunk ends at the
    sequence's last known token, so the step produces the sequence's next token."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int


@dataclass(frozen=True)
class StepPlan:
    """Run one step of `epoch`. `free`: sequences whose KV cache to drop first.
    `delay_s`: injected slowness (chaos), slept before the first collective.
    `dispatch_rows`: rows per peer of the padded dispatch (same on every rank), 0 = exchange
    split sizes."""

    epoch: int
    step: int
    chunks: list[ChunkPlan]
    free: list[int]
    delay_s: float = 0.0
    dispatch_rows: int = 0


@dataclass(frozen=True)
class StepResult:
    """tokens: seq_id -> sampled token; expert_load: [L, E] tokens this rank routed to each
    logical expert; slot_tokens: tokens its own slots computed (all layers)."""

    epoch: int
    step: int
    rank_id: int
    tokens: dict[int, int]
    step_s: float
    compute_s: float
    dispatch_wait_s: float
    combine_wait_s: float
    expert_load: np.ndarray
    slot_tokens: int


@dataclass(frozen=True)
class StepFailed:
    epoch: int
    step: int
    rank_id: int
    error: str


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- worker heartbeat thread -> controller, health socket --------------------------------


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
    """What the agent needs to start workers: `worker_args` are passed to every worker
    (see runtime.worker.WorkerArgs)."""

    worker_args: dict[str, Any]


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
    node: str
    site: BackupSite
    experts: list[tuple[int, int]]
    nbytes: int


@dataclass(frozen=True)
class AgentShutdown:
    pass


@dataclass(frozen=True)
class AgentBye:
    """An agent is stopping: its ranks and its backup go with it."""

    node: str


# ---- worker <-> agent of another node ------------------------------------------------------


@dataclass(frozen=True)
class BackupFetch:
    """Ask a node's agent for experts of its backup: items are (layer, expert)."""

    items: list[tuple[int, int]]


@dataclass(frozen=True)
class DenseFetch:
    """Ask a node's agent for the dense weights it keeps in host memory."""


@dataclass(frozen=True)
class DenseTensors:
    """tensors: name -> numpy float32 array; error if the agent holds none."""

    tensors: dict[str, np.ndarray]
    error: str = ""


@dataclass(frozen=True)
class BackupTensors:
    """w13: [n, 2I, H], w2: [n, H, I] as numpy float32, in the order asked; error if any is missing."""

    w13: np.ndarray | None
    w2: np.ndarray | None
    error: str = ""
