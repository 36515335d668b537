"""Launching a worker, and the worker's main thread <-> the controller (step socket)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from .fetch import BackupSite


@dataclass(frozen=True)
class WorkerLaunch:
    """What every worker of the cluster is started with; the controller sends it to each agent in
    `AgentWelcome`. heartbeat_interval_s 0: no heartbeats (only to measure their cost)."""

    model_dir: str
    step_addr: str
    health_addr: str
    store_host: str
    store_port: int
    backend: str
    max_num_seqs: int
    max_model_len: int
    heartbeat_interval_s: float
    dense_fetch_timeout_s: float = 10.0


@dataclass(frozen=True)
class WorkerArgs:
    """One worker's command-line argument (JSON): the cluster's `WorkerLaunch` plus what its
    agent decides: its rank, node, join mode and where its dense weights come from
    (`dense_path`: this node's backup file; `dense_addr`: another node's agent; neither: disk)."""

    launch: WorkerLaunch
    rank_id: int
    node: str
    join_mode: str = "initial"
    dense_path: str = ""
    dense_addr: str = ""

    def to_json(self) -> str:
        """Flat JSON (`"rank_id": N,` is how `elastic-ep doctor` finds a rank's process)."""
        fields = asdict(self)
        return json.dumps({**fields.pop("launch"), **fields})

    @classmethod
    def from_json(cls, text: str) -> WorkerArgs:
        fields = json.loads(text)
        launch = {k: fields.pop(k) for k in WorkerLaunch.__dataclass_fields__ if k in fields}
        return cls(WorkerLaunch(**launch), **fields)


# ---- worker <-> controller, step socket -------------------------------------------------


@dataclass(frozen=True)
class WorkerHello:
    """A worker process is up, has its dense weights and waits for an epoch."""

    rank_id: int
    node: str
    pid: int
    join_mode: str  # "initial" | "recover"
    dense_source: str = "disk"  # "host_memory" | "peer" | "disk" (runtime/dense.py)
    load_s: float = 0.0
    warmup_s: float = 0.0  # the dummy forward it ran before registering (runtime/worker.py)


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
class EpochStart:
    """Form the group of `epoch` with `members` (rank_ids; position = group rank), hold the
    experts of `phy2log` [L, num_ranks * slots_per_rank] and fill each slot as `sources` says.

    `sources` lists, for the receiving rank only, every slot whose contents change, plus
    `sends`: (dst_rank, layer, src_slot) this rank must send to peers, in the order the peer
    expects them. `reuse_group`: same members as the current epoch, whose group is healthy: keep
    it (no rendezvous); a rank that no longer has it answers `EpochFailed`.
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
    reuse_group: bool = False


@dataclass(frozen=True)
class TransferStat:
    source: str
    bytes_moved: int
    seconds: float


@dataclass(frozen=True)
class EpochReady:
    """The rank is in the group of `epoch`, holds its slots and has checked them.

    checksums: (layer, slot) -> checksum of the expert now in each slot this epoch filled (the
    slots kept as they were are left to the background check; see runtime.experts).
    source_checksums: (layer, expert) -> checksum of the weights as read from the checkpoint,
    for every expert this rank read from disk: the controller's reference for that expert.
    """

    epoch: int
    rank_id: int
    checksums: dict[tuple[int, int], int]
    source_checksums: dict[tuple[int, int], int]
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
class SweepSlots:
    """Between steps, checksum these (layer, slot) of the rank's slots and answer
    `SlotChecksums`: the background check that finds a slot whose weights changed in place."""

    epoch: int
    slots: list[tuple[int, int]]


@dataclass(frozen=True)
class SlotChecksums:
    epoch: int
    rank_id: int
    checksums: dict[tuple[int, int], int]


@dataclass(frozen=True)
class CorruptSlot:
    """Fault injection: overwrite the weights of (layer, slot) of this rank in place."""

    epoch: int
    layer: int
    slot: int


@dataclass(frozen=True)
class Shutdown:
    pass
