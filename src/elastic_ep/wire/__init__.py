"""Every message that crosses a process boundary on the control plane, and the launch spec of
a worker process (`worker.py`: launch and step socket; `health.py`: heartbeats and agents;
`fetch.py`: agent fetch socket). The controller (`control/`), the node agent (`node/`) and the worker
(`runtime/`) all import this module and nothing of each other.

Transport: ZeroMQ. The controller binds three ROUTER sockets:
- the step socket: each worker's main thread (DEALER, identity `w<rank_id>`) receives
  `EpochStart`, `StepPlan`, `ResendResult`, `SweepSlots`, `ChaosStep` and `CorruptSlot` (fault injection), `SleepRank`,
  `WakeRank`, `WarmUp`, `Shutdown` and answers `WorkerHello`, `EpochReady`, `EpochFailed`, `StepResult`,
  `StepFailed`, `SlotChecksums`, `SleepReply`, `WarmedUp`;
- the health socket: each node agent (DEALER, identity `a<node>`) sends `AgentHello`, `NodeHeartbeat`
  (its ranks' heartbeats, one message per interval), `NodeStepResults` (its ranks' `StepResult`s
  of a step, with --step-results-via agent), `WorkerStarted`, `WorkerExited`, `WorkerStartFailed`, `WorkerFenced`,
  `HardwareReport` and receives `AgentWelcome`, `BackupAssign`, `StartWorker`, `FenceWorker`,
  `SignalWorker`, `AbortEpoch` (for its ranks named in it), `AgentShutdown`, and says `AgentBye` when it stops;
- the plan socket (send only): with --step-plans-via agent each node agent connects a DEALER
  (identity `p<node>`) and receives one `NodeStepPlans` per step for its node's members, which it
  relays as it came to its workers on a loopback PUB socket (each worker's SUB takes its own plan out).
An agent also binds a ROUTER on loopback for its own workers' heartbeat threads (DEALER, identity
`h<rank_id>`), which send it `Heartbeat` and receive the `AbortEpoch` it relays; with
--step-results-via agent a PULL on loopback for its workers' main threads' `StepResult`s (a resent
answer and every `StepFailed` go to the controller directly); with --step-plans-via agent a PUB
on loopback that relays the controller's `NodeStepPlans` to its workers' SUB sockets; a ROUTER for
`BackupFetch` -> `BackupTensors` and `DenseFetch` -> `DenseTensors` from workers of other nodes;
and writes `NewLeader` to its own workers on their stdin (wire/pipe.py) when the controller
group's leader changes. With `serve --ha-journal-via direct` the group's leader binds a ROUTER for
its standbys (DEALER, identity their node), which send `JournalFollow` and receive `JournalState`
and `JournalBatch` (`journal.py`).

Frames are typed msgspec structs in msgpack, each with an HMAC of the deployment's cluster key
(`codec.py`): never pickle, since a frame from the network is data, not code. Each receiving side
accepts one union below (`STEP_TO_CONTROLLER`, ...); a frame that is not authenticated, does not
decode or is not of that union is dropped and counted, never raised. Every message a worker acts
on carries its epoch; a worker drops a message of an epoch other than its current or next one
(a step plan of a later epoch waits for its `EpochStart`: runtime/plan_order.py), which is what
keeps a fenced or late process out of a newer epoch.
"""

from __future__ import annotations

from .codec import (
    KEY_ENV,
    ClusterKey,
    ClusterKeyError,
    Inbox,
    Message,
    TermFence,
    decoder,
    encode,
    key_from_env,
    reject_invalid,
    rejected_counts,
)
from .fetch import (
    BackupFetch,
    BackupSite,
    BackupTensors,
    DenseFetch,
    DenseTensors,
)
from .hardware import IDLE_REASONS, THROTTLE_REASONS, GpuSignals, HardwareReport
from .health import (
    AGENT_HELLO_INTERVAL_S,
    AbortEpoch,
    AgentAlive,
    AgentBye,
    AgentHello,
    AgentShutdown,
    AgentWelcome,
    BackupAssign,
    BackupReady,
    ChaosFailed,
    CutLinks,
    FenceWorker,
    HealLinks,
    Heartbeat,
    LeaseRenew,
    NodeHeartbeat,
    NodeStepResults,
    Progress,
    RankBeat,
    SessionEnded,
    SignalWorker,
    StartWorker,
    WorkerExited,
    WorkerFenced,
    WorkerStarted,
    WorkerStartFailed,
    exit_reason,
)
from .journal import JournalBatch, JournalFollow, JournalState
from .slot_map import (
    HeldSlotMaps,
    SharedSlotMaps,
    SlotMap,
    SlotMapDelta,
    SlotMapUnusable,
    slot_map_delta,
    slot_map_for_wire,
)
from .worker import (
    SAMPLED_TOKEN,
    ChaosStep,
    ChunkPlan,
    CorruptSlot,
    DecodeRows,
    EpochFailed,
    EpochReady,
    EpochStart,
    HeldKV,
    KVMove,
    Membership,
    NewLeader,
    NodePlan,
    NodeStepPlans,
    ResendResult,
    Shutdown,
    SleepRank,
    SleepReply,
    SlotChecksums,
    SlotSource,
    StepErrorKind,
    StepFailed,
    StepPlan,
    StepResult,
    SweepSlots,
    TransferStat,
    WakeRank,
    WarmedUp,
    WarmUp,
    WorkerArgs,
    WorkerHello,
    WorkerLaunch,
    node_step_plans,
)

__all__ = [
    "AGENT_TO_WORKER",
    "WORKER_TO_AGENT",
    "WORKER_TO_AGENT_RESULTS",
    "AGENT_HELLO_INTERVAL_S",
    "RELAYED_TO_WORKER",
    "AbortEpoch",
    "AgentAlive",
    "AgentBye",
    "AgentHello",
    "AgentShutdown",
    "AgentWelcome",
    "BackupAssign",
    "BackupFetch",
    "BackupReady",
    "BackupSite",
    "BackupTensors",
    "ChaosFailed",
    "ChaosStep",
    "ResendResult",
    "ChunkPlan",
    "CorruptSlot",
    "CutLinks",
    "SAMPLED_TOKEN",
    "DecodeRows",
    "DenseFetch",
    "DenseTensors",
    "EpochFailed",
    "EpochReady",
    "EpochStart",
    "FenceWorker",
    "GpuSignals",
    "HardwareReport",
    "IDLE_REASONS",
    "THROTTLE_REASONS",
    "HealLinks",
    "Heartbeat",
    "HeldKV",
    "JournalBatch",
    "JournalFollow",
    "JournalState",
    "KVMove",
    "NewLeader",
    "LeaseRenew",
    "NodeHeartbeat",
    "NodeStepResults",
    "NodePlan",
    "NodeStepPlans",
    "node_step_plans",
    "Progress",
    "RankBeat",
    "Shutdown",
    "SessionEnded",
    "SignalWorker",
    "SleepRank",
    "SleepReply",
    "SlotChecksums",
    "SlotSource",
    "StartWorker",
    "StepErrorKind",
    "StepFailed",
    "StepPlan",
    "StepResult",
    "SweepSlots",
    "TransferStat",
    "WakeRank",
    "WarmUp",
    "WarmedUp",
    "WorkerArgs",
    "WorkerExited",
    "WorkerStartFailed",
    "WorkerFenced",
    "WorkerHello",
    "WorkerLaunch",
    "slot_map_for_wire",
    "slot_map_delta",
    "HeldSlotMaps",
    "SharedSlotMaps",
    "Membership",
    "SlotMap",
    "SlotMapDelta",
    "SlotMapUnusable",
    "WorkerStarted",
    "exit_reason",
    "decoder",
    "encode",
    "ALL_MESSAGES",
    "CONTROLLER_TO_AGENT",
    "CONTROLLER_TO_HEARTBEAT",
    "CONTROLLER_TO_WORKER",
    "FETCH_REPLY",
    "FETCH_REQUEST",
    "HEALTH_TO_CONTROLLER",
    "LEADER_TO_STANDBY",
    "STANDBY_TO_LEADER",
    "KEY_ENV",
    "STEP_TO_CONTROLLER",
    "ZMQ_HEARTBEAT_IVL_MS",
    "ZMQ_HEARTBEAT_TIMEOUT_MS",
    "PLAN_MAX_FRAME_BYTES",
    "ClusterKey",
    "ClusterKeyError",
    "Inbox",
    "TermFence",
    "Message",
    "key_from_env",
    "rejected_counts",
    "reject_invalid",
]


# ZeroMQ's own peer heartbeat (HEARTBEAT_IVL / HEARTBEAT_TIMEOUT on the controller's ROUTERs and
# the agent's DEALER) only closes a connection that died silently (a cut link), so that the
# reconnection once it heals is clean. It detects no dead rank or agent: --heartbeat-timeout-s and
# --agent-timeout-s do, from the project's own heartbeats. At 250 ms / 1 s a peer whose I/O thread
# answers late for a second (a loaded host, big frames: an earlier session counted 618 of 1,024
# stand-in connections dropped at the first EpochStart) lost its connection, and with it the
# frames sent before it reconnected.
ZMQ_HEARTBEAT_IVL_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 10_000
PLAN_MAX_FRAME_BYTES = 64 << 20  # a node's plans (a prefill's tokens for each rank): as big as a step socket frame

# What each receiving side accepts (its inbox's union).
STEP_TO_CONTROLLER = (WorkerHello | EpochReady | EpochFailed | StepResult | StepFailed | SlotChecksums | SleepReply
                      | WarmedUp)
CONTROLLER_TO_WORKER = (EpochStart | StepPlan | ResendResult | ChaosStep | SweepSlots | CorruptSlot | SleepRank
                        | WakeRank | WarmUp | Shutdown)
HEALTH_TO_CONTROLLER = (NodeHeartbeat | NodeStepResults | AgentHello | AgentAlive | WorkerStarted | WorkerExited
                        | WorkerStartFailed | WorkerFenced | HardwareReport | ChaosFailed | BackupReady | AgentBye)
WORKER_TO_AGENT = Heartbeat  # the agent's beat socket
WORKER_TO_AGENT_RESULTS = StepResult  # the agent's result socket (--step-results-via agent)
CONTROLLER_TO_HEARTBEAT = AbortEpoch  # relayed by the agent
RELAYED_TO_WORKER = NodeStepPlans  # the controller's plan socket -> the agent -> the worker's plan socket
AGENT_TO_WORKER = NewLeader
CONTROLLER_TO_AGENT = (AgentWelcome | LeaseRenew | SessionEnded | BackupAssign | StartWorker | FenceWorker
                       | SignalWorker | CutLinks | HealLinks | AbortEpoch | AgentShutdown)
FETCH_REQUEST = BackupFetch | DenseFetch
FETCH_REPLY = BackupTensors | DenseTensors
STANDBY_TO_LEADER = JournalFollow  # the leader's journal socket (serve --ha-journal-via direct)
LEADER_TO_STANDBY = JournalState | JournalBatch
ALL_MESSAGES = (STEP_TO_CONTROLLER | CONTROLLER_TO_WORKER | HEALTH_TO_CONTROLLER | WORKER_TO_AGENT
                | WORKER_TO_AGENT_RESULTS | RELAYED_TO_WORKER | CONTROLLER_TO_AGENT | AGENT_TO_WORKER | FETCH_REQUEST
                | FETCH_REPLY | STANDBY_TO_LEADER | LEADER_TO_STANDBY)
