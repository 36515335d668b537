"""Launching a worker, and the worker's main thread <-> the controller (step socket)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

import msgspec
import numpy as np

from elastic_ep.model.sampling import SamplingParams, TokenLogprobs

from .codec import JoinMode, Message, Pid, RankId, Record, decoder, encode, narrow_int
from .fetch import BackupSite
from .slot_map import SlotMap


class WorkerLaunch(Record):
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
    connect_timeout_s: float = 30.0  # reaching the controller's store at start
    dtype: str = "auto"  # the weights' dtype when served (model/checkpoint.py: auto = the checkpoint's)
    device: str = "auto"  # cpu, cuda or auto (cuda when present); each rank takes the GPU of its local index
    # the KV pool (model/kv_cache.py: pool_num_blocks): blocks of block_size positions, sized once at start
    block_size: int = 16
    num_gpu_blocks_override: int = 0  # 0: from the budget
    kv_cache_memory: int = 0  # bytes; 0: --gpu-memory-utilization on a GPU, max_num_seqs full requests on a CPU
    gpu_memory_utilization: float = 0.9
    expert_slot_bytes: int = 0  # every expert slot of a rank (redundant ones included), kept out of the budget
    max_num_batched_tokens: int = 256  # the warm-up forward that measures the activation peak runs this many
    # read once, copy many at the first start: an agent reads the dense weights into host memory
    # before its ranks start, and the node's backup before the first epoch (node/host_backup.py)
    read_once: bool = True
    read_rate_mb_s: float = 0.0  # storage reads of every process of this host throttled to this, together (0: not)
    read_rate_path: str = ""  # the file those processes share the throttle through (model/read_throttle.py)
    # the controller's plan socket, where an agent of `--step-plans-via agent` takes its node's plans ("": none)
    plan_addr: str = ""


@dataclass(frozen=True)
class WorkerArgs:
    """One worker's command-line argument (JSON): the cluster's `WorkerLaunch` plus what its
    agent decides: its rank, node, the address of its host (`host`: the data plane binds it),
    join mode, where its dense weights come from (`dense_path`: this node's backup file;
    `dense_addr`: another node's agent; neither: disk) and where its heartbeat thread beats
    (`beat_addr`: the agent's loopback beat socket), where its step results go (`result_addr`:
    the agent's loopback result socket, which gathers them per node; empty: to the controller) and
    where its node's step plans come from besides the step socket (`plan_relay_addr`: the agent's
    loopback PUB socket, which relays the controller's `NodeStepPlans` as they came; empty: none)."""

    launch: WorkerLaunch
    rank_id: int
    node: str
    host: str = "127.0.0.1"
    local_index: int = 0  # its place among the ranks of its node: picks its GPU
    join_mode: str = "initial"
    dense_path: str = ""
    dense_addr: str = ""
    beat_addr: str = ""
    result_addr: str = ""
    plan_relay_addr: str = ""

    def to_json(self) -> str:
        """Flat JSON (`"rank_id": N,` is how `elastic-ep doctor` finds a rank's process)."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "launch"}
        return json.dumps({**msgspec.structs.asdict(self.launch), **fields})

    def title(self) -> str:
        """What a worker forked from its node's zygote shows as its command line (node/zygote.py):
        the module it runs and, as in `to_json`, `"rank_id": N,`."""
        return f"elastic_ep.runtime.worker {json.dumps({'rank_id': self.rank_id, 'node': self.node})}"

    @classmethod
    def from_json(cls, text: str) -> WorkerArgs:
        fields = json.loads(text)
        launch = {k: fields.pop(k) for k in WorkerLaunch.__struct_fields__ if k in fields}
        return cls(WorkerLaunch(**launch), **fields)


# ---- worker <-> controller, step socket -------------------------------------------------


class HeldKV(Record):
    """A sequence whose KV an adopted rank still holds (`WorkerHello` join_mode adopt): the last
    leader's `seq_id`, its `prompt_len`, the tokens at its first len(token_ids) positions (written
    whole, every layer, by steps that completed) and the blocks that hold them (its block table's
    first blocks_for(len(token_ids)) blocks, ids below the hello's kv_blocks). A new leader takes
    them over for the journaled request with those tokens (control/serving/adopted_kv.py)."""

    seq_id: int
    prompt_len: int
    token_ids: list[int]
    block_ids: list[int]


class WorkerHello(Message):
    """A worker process is up, has its dense weights and waits for an epoch."""

    rank_id: RankId
    node: str
    pid: Pid
    join_mode: JoinMode  # "adopt": running under the last leader (`NewLeader`)
    dense_source: str = "disk"  # "host_memory" | "peer" | "disk" (runtime/dense.py)
    load_s: float = 0.0
    warmup_s: float = 0.0  # the dummy forward it ran before registering (runtime/worker.py)
    device: str = "cpu"  # where it computes: "cpu", "cuda:0", ...
    kv_blocks: int = 0  # its KV pool's blocks (of WorkerLaunch.block_size positions)
    version: str = ""  # the elastic-ep it runs (a rolling restart rolls out what is installed on the node)
    dense_bytes: int = 0  # the dense weights it loaded (from `dense_source`)
    # adopted ranks: the highest epoch it was told of, and the epoch whose slots it holds whole (-1: none,
    # or a later epoch began changing them): the placement a new leader may trust for this rank
    epoch: int = -1
    held_epoch: int = -1
    held_kv: list[HeldKV] = msgspec.field(default_factory=list)  # adopted ranks: the sequences whose KV it kept


class NewLeader(Message):
    """Agent -> its worker (the worker's stdin, runtime/agent_link.py): the controller group has a new
    leader; `launch` holds its sockets and store. The worker leaves the last leader's epoch, connects
    there and registers again (`WorkerHello` join_mode "adopt") with its weights, slots and KV pool
    as they are; the frame's term is the new leader's, so the old one's frames are dropped from now on."""

    launch: WorkerLaunch


class SlotSource(Record):
    """Where one slot of the receiving rank gets its expert in a new epoch.

    kind: "keep" (already there), "local" (slot `src_slot` of the same rank, old contents),
    "peer" (slot `src_slot` of rank `src_rank`, sent in the epoch group's exchange),
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


class Membership(Record):
    """An epoch's members and the node (host) of each, as columns: `rank_ids` [n] (position = group
    rank), `node_names` the distinct nodes, `node_of` [n] each member's index into them (both
    int16 where the values fit, else int32); no nodes: one host. Every member decodes it: at 1,024
    members a list of ids and one of node names took ~34 us a rank, these ~7. A frame whose columns
    do not fit is refused."""

    rank_ids: np.ndarray
    node_names: list[str] = []
    node_of: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.rank_ids.ndim != 1 or self.rank_ids.dtype.kind not in "iu":
            raise ValueError("an epoch's rank ids are one column of integers")
        if self.node_of is None:
            if self.node_names:
                raise ValueError("an epoch's node names need each member's node")
            return
        index = self.node_of
        if index.shape != self.rank_ids.shape or index.dtype.kind not in "iu" or (
                len(index) and not 0 <= int(index.min()) <= int(index.max()) < len(self.node_names)):
            raise ValueError("an epoch's members need one node each, among its node names")

    @classmethod
    def of(cls, members: list[int], nodes: list[str] | None = None) -> Membership:
        """`members` (rank ids, in group order) on `nodes` (each one's node; None or empty: one host)."""
        rank_ids = np.asarray(members, dtype=narrow_int(max(members, default=0))).reshape(-1)
        if not nodes:
            return cls(rank_ids)
        names = list(dict.fromkeys(nodes))
        index = {name: i for i, name in enumerate(names)}
        return cls(rank_ids, names, np.array([index[n] for n in nodes], dtype=narrow_int(len(names))))

    @property
    def members(self) -> list[int]:
        return self.rank_ids.tolist()

    @property
    def nodes(self) -> list[str]:
        """Each member's node, in member order (empty: one host)."""
        return [] if self.node_of is None else [self.node_names[i] for i in self.node_of.tolist()]


class EpochStart(Message):
    """Form the group of `epoch` with the members of `membership` (rank_ids; position = group
    rank), hold the experts of the placement `slot_map` describes (`phy2log` [L, num_ranks *
    slots_per_rank]: whole, or the changes since a map this rank confirmed, wire/slot_map.py) and
    fill each slot as `sources` says.

    `sources` lists, for the receiving rank only, every slot whose contents change, plus
    `sends`: (dst_rank, layer, src_slot) this rank must send to peers, in the order the peer
    expects them. `nodes`: the node (host) of each member, in member order (empty: one host);
    `all2all_backend`: "flat" or "hierarchical" (two-stage over those hosts, runtime/hierarchical.py).
    `reuse_group`: same members as the current epoch, whose group is healthy: keep
    it (no rendezvous); a rank that no longer has it answers `EpochFailed`. The map travels in
    the narrowest integer type that holds its expert ids (`slot_map_for_wire`: int16 up to 32,767
    experts); whole, at 1,024 ranks of DeepSeek-V3's 58 x 256 experts it is ~0.25 MB a rank, so a
    rank that confirmed the last epoch's map gets only what changed.
    """

    epoch: int
    membership: Membership
    slot_map: SlotMap
    slots_per_rank: int
    sources: list[SlotSource]
    sends: list[tuple[int, int, int]]
    backups: dict[str, BackupSite]
    collective_timeout_s: float
    backup_fetch_timeout_s: float
    all2all_backend: str = "flat"
    reuse_group: bool = False

    @property
    def members(self) -> list[int]:
        return self.membership.members

    @property
    def nodes(self) -> list[str]:
        return self.membership.nodes


class TransferStat(Record):
    source: str
    bytes_moved: int
    seconds: float


class EpochReady(Message):
    """The rank is in the group of `epoch`, holds its slots and has checked them.

    checksums: (layer, slot) -> checksum of the expert now in each slot this epoch filled (the
    slots kept as they were are left to the background check; see runtime.experts).
    source_checksums: (layer, expert) -> checksum of the weights as read from the checkpoint,
    for every expert this rank read from disk: the controller's reference for that expert.
    slots_warmed: slots that computed once, on this rank alone, before this answer (every slot the
    epoch filled and any other not warm in this process yet: runtime/warmth.py), in `warm_s`.
    steps_run: (tokens, micro-batches) of every step shape the readiness gate ran in this process
    (control/serving/warmup.py asks the group for the ones a member lacks).
    """

    epoch: int
    rank_id: int
    checksums: dict[tuple[int, int], int]
    source_checksums: dict[tuple[int, int], int]
    transfers: list[TransferStat]
    rendezvous_s: float
    transfer_s: float
    verify_s: float
    slots_warmed: int = 0
    warm_s: float = 0.0
    steps_run: list[tuple[int, int]] = []


class EpochFailed(Message):
    """`unreachable_node`: the node whose expert backup did not answer (its agent is gone)."""

    epoch: int
    rank_id: int
    error: str
    unreachable_node: str = ""


class ChunkPlan(Record):
    """One sequence's tokens in a step. `sample` is set when this chunk ends at the
    sequence's last known token, so the step produces the sequence's next token. The first
    `prompt_len` tokens of the sequence are its prompt, the rest its output so far (the
    sampler's penalties and min_tokens tell them apart)."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    sample: bool
    params: SamplingParams
    seed: int
    prompt_len: int
    block_ids: list[int] = msgspec.field(default_factory=list)  # the sequence's whole block table on this rank
    # a prefix hit: the tokens at [0, start_pos) whose KV the shared blocks hold, sent with the first chunk
    cached_token_ids: list[int] = msgspec.field(default_factory=list)


# A decode row's token that the rank fills in: the one it sampled for the sequence in the step before
SAMPLED_TOKEN = -1


class DecodeRows(Record):
    """A step's decode tokens on one rank, as flat lists (one row per sequence, no record each):
    row i runs token `tokens[i]` of sequence `seq_ids[i]` at position `positions[i]` and samples
    its next token. Only for sequences the rank keeps: their sampling params, seed, prompt length
    and block table came with a `ChunkPlan` of this epoch on this rank and were not freed since
    (runtime/worker.py `Kept`). `new_blocks`: (seq_id, block_id) appended to the block table of a
    row's sequence, in order, when its token crosses into a block the rank has not been told of.
    At 256 ranks x 64 decoding sequences this is 256 of these a step instead of 16,384 `ChunkPlan`s
    of ~64 block ids each. A token `SAMPLED_TOKEN` is the token this rank sampled for that sequence
    in the step before, of the same epoch (a step planned while that one ran, serve
    --async-scheduling); a rank that did not sample it there fails the step (LOCAL), never guesses."""

    seq_ids: list[int] = msgspec.field(default_factory=list)
    tokens: list[int] = msgspec.field(default_factory=list)
    positions: list[int] = msgspec.field(default_factory=list)
    new_blocks: list[tuple[int, int]] = msgspec.field(default_factory=list)


class KVMove(Record):
    """Copy the KV cache of `seq_id` (its first len(token_ids) positions, which hold
    `token_ids`) from rank `src_rank` to rank `dst_rank` at the start of the step (DP alignment
    moves a decoding sequence off a rank that stays the busiest). The source keeps its copy
    until the controller frees it."""

    seq_id: int
    src_rank: int
    dst_rank: int
    token_ids: list[int]
    dst_block_ids: list[int] = msgspec.field(default_factory=list)  # its block table on the destination


class StepPlan(Message):
    """Run one step of `epoch`. `free`: sequences whose KV cache to drop first.
    `dispatch_rows`: rows per peer of the padded dispatch (same on every rank), 0 = exchange
    split sizes.
    `micro_batches`: forwards interleaved in this step (2 with --enable-dbo; same on every rank).
    `kv_moves`: every KV move of the step, the same list to every member (the moves are one
    all-to-all of the group, each member takes its side). `report_load`: answer with the expert
    load summed since the last step that asked (the controller asks every few steps: a [L, E]
    array per rank per step is 119 KB at DeepSeek-V3's size). `pad_tokens`: dummy tokens run after
    the chunks so that the rank's step has a shape the readiness gate warmed (its tokens padded to
    the next warmed bucket, control/serving/warmup.py); their outputs are dropped, their expert
    load not counted. `decode`: the decode rows of sequences the rank keeps, run after `chunks`
    (None: none)."""

    epoch: int
    step: int
    chunks: list[ChunkPlan]
    free: list[int]
    dispatch_rows: int = 0
    micro_batches: int = 1
    kv_moves: list[KVMove] = msgspec.field(default_factory=list)
    report_load: bool = True
    pad_tokens: int = 0
    decode: DecodeRows | None = None


class NodePlan(Record):
    """One plan of a `NodeStepPlans`, as the msgpack of its `StepPlan`, and the ranks of the node it
    is for (several for a plan they share, such as the empty plan). Raw bytes, encoded once by the
    controller: a rank decodes only its own plan, not its node's eight."""

    rank_ids: list[int]
    plan: msgspec.Raw


class NodeStepPlans(Message):
    """Controller -> a node's agent (its plan socket) -> each of the node's workers, relayed as it came
    (`--step-plans-via agent`): the step plans of the node's members for one step, each plan once.
    Sealed once by the controller with the term the workers fence on: the agent does not seal it
    again, each worker checks the controller's MAC and decodes its own plan (`plan_of`)."""

    node: str
    epoch: int
    step: int
    plans: list[NodePlan]

    def plan_of(self, rank_id: int) -> StepPlan | None:
        """The plan for `rank_id`, None when the node's frame has none for it (a rank not a member).
        Raises msgspec.DecodeError when its bytes are not a `StepPlan` (the frame's MAC held: a
        controller of another version), which the reader drops and counts as an undecodable frame."""
        for node_plan in self.plans:
            if rank_id in node_plan.rank_ids:
                return _STEP_PLAN.decode(node_plan.plan)
        return None


_STEP_PLAN = decoder(StepPlan)


def node_step_plans(node: str, plans: list[tuple[int, StepPlan]],
                    encoded: dict[int, msgspec.Raw] | None = None) -> NodeStepPlans:
    """The `NodeStepPlans` of `node` from its members' (rank_id, plan), all of one step; a plan object
    given for several ranks is encoded once and carried once with their ids. `encoded` (id(plan) ->
    its bytes), shared by a step's nodes, encodes a plan given to several nodes (the empty plan) once."""
    assert plans, "a node's frame carries at least one plan"
    by_plan: dict[int, tuple[list[int], StepPlan]] = {}  # id(plan) -> its ranks, the plan
    for rank_id, plan in plans:
        by_plan.setdefault(id(plan), ([], plan))[0].append(rank_id)
    encoded = {} if encoded is None else encoded
    entries = []
    for key, (rank_ids, plan) in by_plan.items():
        raw = encoded.get(key)
        if raw is None:
            raw = encoded[key] = msgspec.Raw(encode(plan))
        entries.append(NodePlan(rank_ids, raw))
    first = plans[0][1]
    return NodeStepPlans(node, first.epoch, first.step, entries)


class StepResult(Message):
    """tokens: seq_id -> sampled token; expert_load: [L, E] int32 tokens this rank routed to each
    logical expert since the last step whose plan had `report_load` (this one included), or an
    empty [0, 0] array when this plan did not ask or the counts are all zero; slot_tokens: tokens
    its own slots computed (all layers, padding tokens included); logprobs:
    seq_id -> the sampled token's logprobs, for sequences whose params ask for them."""

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
    logprobs: dict[int, TokenLogprobs]
    errors: dict[int, str] = msgspec.field(default_factory=dict)  # seq_id -> why its token could not be sampled
    remote_messages: int = 0  # point-to-point sends of the all-to-alls to ranks on other hosts
    remote_bytes: int = 0
    kv_move_s: float = 0.0  # time in this step's KV moves (sending or receiving)
    shape: int = 0  # tokens this rank's forward ran, padding included (the readiness gate's shapes)


class StepErrorKind(str, Enum):
    """COLLECTIVE: a collective raised (a peer died or the group broke); the rank left the
    group. LOCAL: the rank's own computation raised (its requests, its experts); it still ran
    every collective of the step, so the group is intact and the step can be re-run. NOT_RUN: the
    answer to a `ResendResult` for a step the rank never ran (its plan was lost on the way)."""

    COLLECTIVE = "collective"
    LOCAL = "local"
    NOT_RUN = "not_run"


class StepFailed(Message):
    """`in_experts`: a LOCAL error raised while the rank computed experts for dispatched tokens,
    so the expert outputs it sent back to every rank were zeros."""

    epoch: int
    step: int
    rank_id: int
    error: str
    kind: StepErrorKind = StepErrorKind.COLLECTIVE
    in_experts: bool = False


class ResendResult(Message):
    """The controller heard no answer to (epoch, step) past its deadline while the rank's heartbeats
    say it is not running that step: the rank sends again the answer it kept of its last step (a
    `StepResult` or `StepFailed`) when that is (epoch, step), else `StepFailed` NOT_RUN."""

    epoch: int
    step: int


class SweepSlots(Message):
    """Between steps, checksum these (layer, slot) of the rank's slots and answer
    `SlotChecksums`: the background check that finds a slot whose weights changed in place."""

    epoch: int
    slots: list[tuple[int, int]]


class SlotChecksums(Message):
    epoch: int
    rank_id: int
    checksums: dict[tuple[int, int], int]


class ChaosStep(Message):
    """Fault injection (only from a server started with --enable-chaos), sent just before the
    `StepPlan` of (epoch, step) and applied to that step only: `delay_s` slept before its first
    collective; `fail_at` makes the whole step raise there ("local", "experts" or "sampling");
    `poisoned`: seq_id -> where the steps of that sequence raise; `lose_result`: the rank runs the
    step and keeps its answer but does not send it, as if it were lost on the way (it is sent on
    `ResendResult`); `lose_plan`: the rank drops the step's plan as if it never came (on
    `ResendResult` it answers NOT_RUN)."""

    epoch: int
    step: int
    delay_s: float = 0.0
    fail_at: str = ""
    poisoned: dict[int, str] = msgspec.field(default_factory=dict)
    lose_result: bool = False
    lose_plan: bool = False


class CorruptSlot(Message):
    """Fault injection: overwrite the weights of (layer, slot) of this rank in place."""

    epoch: int
    layer: int
    slot: int


class SleepRank(Message):
    """Between steps, with no sequence running: level 1 frees the KV cache (weights stay, in host
    memory); level 2 also drops the dense weights and the expert slots. Answered `SleepReply`."""

    level: int


class WakeRank(Message):
    """Rebuild what the last `SleepRank` freed (weights from the node's host backup, else disk);
    answered `SleepReply` with level 0."""


class SleepReply(Message):
    """A rank's answer to `SleepRank` (`level` it sleeps at) or `WakeRank` (level 0): its resident
    memory before and after, the seconds it took, and the error when it could not."""

    rank_id: int
    level: int
    rss_before_bytes: int
    rss_after_bytes: int
    seconds: float
    error: str = ""


class WarmUp(Message):
    """The readiness gate (control/serving/warmup.py): run one forward of each of `shapes` dummy
    tokens, cut into the same place's `micro_batches` (2 as a step with --enable-dbo runs it),
    through the epoch's MoE, every (token, choice) sent round robin over the group's slots so that
    every slot computes; answered `WarmedUp`."""

    epoch: int
    shapes: list[int]
    micro_batches: list[int]


class WarmedUp(Message):
    """A rank's warm-up: the shapes it ran, how many of its slots (over every MoE layer) got
    tokens, the seconds it took, and the error when it could not finish."""

    epoch: int
    rank_id: int
    shapes: list[int]
    slots_warmed: int
    seconds: float
    error: str = ""


class Shutdown(Message):
    pass
