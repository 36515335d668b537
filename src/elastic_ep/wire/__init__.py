"""Every message that crosses a process boundary on the control plane, and the launch spec of
a worker process (`worker.py`: launch and step socket; `health.py`: heartbeats and agents;
`fetch.py`: agent fetch socket). The controller (`control/`), the node agent (`node/`) and the worker
(`runtime/`) all import this module and nothing of each other.

Transport: ZeroMQ. The controller binds two ROUTER sockets:
- the step socket: each worker's main thread (DEALER, identity `w<rank_id>`) receives
  `EpochStart`, `StepPlan`, `SweepSlots`, `ChaosStep` and `CorruptSlot` (fault injection), `Shutdown` and answers `WorkerHello`,
  `EpochReady`, `EpochFailed`, `StepResult`, `StepFailed`, `SlotChecksums`;
- the health socket: each worker's heartbeat thread (DEALER, identity `h<rank_id>`) sends
  `Heartbeat` and receives `AbortEpoch`; each node agent (DEALER, identity `a<node>`) sends `AgentHello`,
  `WorkerStarted`, `WorkerExited`, `WorkerFenced`, `HardwareReport` and receives `AgentWelcome`, `BackupAssign`,
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
from typing import Any

from .fetch import (
    BackupFetch,
    BackupSite,
    BackupTensors,
    DenseFetch,
    DenseTensors,
)
from .hardware import IDLE_REASONS, THROTTLE_REASONS, GpuSignals, HardwareReport
from .health import (
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
    Progress,
    SessionEnded,
    SignalWorker,
    StartWorker,
    WorkerExited,
    WorkerFenced,
    WorkerStarted,
    exit_reason,
)
from .worker import (
    ChaosStep,
    ChunkPlan,
    CorruptSlot,
    EpochFailed,
    EpochReady,
    EpochStart,
    KVMove,
    Shutdown,
    SlotChecksums,
    SlotSource,
    StepErrorKind,
    StepFailed,
    StepPlan,
    StepResult,
    SweepSlots,
    TransferStat,
    WorkerArgs,
    WorkerHello,
    WorkerLaunch,
)

__all__ = [
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
    "ChunkPlan",
    "CorruptSlot",
    "CutLinks",
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
    "KVMove",
    "LeaseRenew",
    "Progress",
    "Shutdown",
    "SessionEnded",
    "SignalWorker",
    "SlotChecksums",
    "SlotSource",
    "StartWorker",
    "StepErrorKind",
    "StepFailed",
    "StepPlan",
    "StepResult",
    "SweepSlots",
    "TransferStat",
    "WorkerArgs",
    "WorkerExited",
    "WorkerFenced",
    "WorkerHello",
    "WorkerLaunch",
    "WorkerStarted",
    "exit_reason",
    "decode",
    "encode",
]


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes) -> Any:
    return pickle.loads(frame)
