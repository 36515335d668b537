"""Stand-in ranks: hundreds of EP ranks in a few processes, speaking the real wire protocol to the
real controller, so the control plane (controller, detector, scheduler, placement, publisher,
metrics) runs as in production at sizes one machine cannot run real ranks at.

`python -m elastic_ep.harness.standin --controller tcp://HOST:PORT --node n0 --node n1 ...`
runs one stand-in agent per `--node` in this process, each registering like `elastic-ep agent`
(`AgentHello`, lease, `AgentAlive`, `HardwareReport`, `BackupReady` for its backup share) and
offering `--ranks-per-node` ranks. For every `StartWorker` the agent starts a stand-in rank (no
process): it says `WorkerStarted`, and the rank opens its step socket, registers (`WorkerHello`),
beats every `heartbeat_interval_s` with its progress (to its agent, in memory: the agent sends the
controller one `NodeHeartbeat` per interval with each rank's progress and the age of its last
beat, as `elastic-ep agent` does with its workers' beats), forms each epoch
(`EpochReady` with the checksums of the slots it filled and the references of what it read from
disk, or `EpochFailed` when asked to keep a group it has not got or sent a slot map it cannot
rebuild: wire/slot_map.py, the ranks of a process sharing the arrays of the maps they rebuilt
where a worker keeps its own), warms up as a real rank does
(runtime/warmth.py: each slot an epoch fills, or not yet warm in this stand-in's life, takes
`--warm-slot-ms` before `EpochReady`, which names the shapes it has run; each forward a `WarmUp`
asks takes a step's set time, every slot computing), answers `SweepSlots`, and
answers each `StepPlan` after `--step-ms` (plus `--jitter-ms` drawn per step, plus `--slow
RANK:MS`) with a `StepResult` of the real shape: a token per sampled chunk, timings, and the
expert load of its tokens at the model's size; it keeps that answer and sends it again on
`ResendResult` (a `ChaosStep` with `lose_result` has it not sent the first time). With
`--step-results-via agent` a rank hands its `StepResult` to its agent (in memory), which sends the
controller its node's results of a step as one `NodeStepResults`, gathered as `elastic-ep agent
--step-results-via agent` gathers them (node/step_gather.py); resent answers and `StepFailed` go
from the rank directly, as a real rank's do. With `--step-plans-via agent` each agent connects to
the controller's plan socket, as `elastic-ep agent --step-plans-via agent` does, and hands each of
its running ranks its plan out of the node's `NodeStepPlans` (in memory: the frame decoded once per
node, where a real node's workers each read it, then each rank's own plan, as a worker decodes it);
a rank takes a plan, from either path, by runtime/plan_order.py's rules. There is no data plane
and no model: the checkpoint is only read for its config.

Faults arrive as they do for real ranks, through the agent (`/chaos/kill`, `/chaos/hang`,
`/chaos/resume` send `SignalWorker`): SIGKILL stops a rank's messages and its agent reports
`WorkerExited` (-9), as a real agent reports a worker exit; SIGSTOP silences it (no heartbeats,
no answers, nothing reported) until SIGCONT; `FenceWorker` kills it and confirms with
`WorkerFenced`. An `AbortEpoch` (to the agent, naming its ranks) makes each rank named that has not
answered the epoch's step answer `StepFailed` (collective), as a real rank's collective gives up.

Each process is one thread: a rank's tokens and load are worked out when its plan arrives and
its answer is sent when its set time has passed, so most of the harness's own work overlaps the
ranks' "compute"; `step_s` in a result is the time from the plan's arrival to the send, so a
harness that falls behind shows as slower ranks, never as controller time. `compute_s`, the own
time the straggler verdict judges, is the rank's set time (with its jitter and `--slow`): a
process that answers late because its ranks share a core is the harness's wait, not one rank
slower than its peers, and the straggler policy must not derate it. Frames carry the
deployment's cluster key (`--cluster-key-file`, else $ELASTIC_EP_CLUSTER_KEY), as an agent's do.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import random
import select
import signal
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from elastic_ep.model.config import MoEConfig
from elastic_ep.model.tiny import cache_dir, make_tiny
from elastic_ep.node.lease import Lease
from elastic_ep.node.step_gather import StepGather, node_results
from elastic_ep.parent_death import end_with_parent
from elastic_ep.runtime.plan_order import PlanOrder, Verdict
from elastic_ep.runtime.warmth import slots_to_warm
from elastic_ep.wire import (
    CONTROLLER_TO_AGENT,
    CONTROLLER_TO_WORKER,
    RELAYED_TO_WORKER,
    AbortEpoch,
    AgentAlive,
    AgentBye,
    AgentHello,
    AgentShutdown,
    AgentWelcome,
    BackupAssign,
    BackupReady,
    BackupSite,
    ChaosStep,
    ClusterKey,
    EpochFailed,
    EpochReady,
    EpochStart,
    FenceWorker,
    HardwareReport,
    HeldSlotMaps,
    Inbox,
    LeaseRenew,
    NodeHeartbeat,
    NodeStepPlans,
    Progress,
    RankBeat,
    ResendResult,
    SessionEnded,
    SharedSlotMaps,
    Shutdown,
    SignalWorker,
    SlotChecksums,
    SlotMapUnusable,
    StartWorker,
    StepErrorKind,
    StepFailed,
    StepPlan,
    StepResult,
    SweepSlots,
    TransferStat,
    WarmedUp,
    WarmUp,
    WorkerExited,
    WorkerFenced,
    WorkerHello,
    WorkerLaunch,
    WorkerStarted,
    key_from_env,
)
from elastic_ep.wire.receive import recv_parts

EMPTY_LOAD = np.zeros((0, 0), dtype=np.int32)
PID_BASE = 4_000_000  # stand-in pids: above any real pid, unique per rank and incarnation


def standin_model(experts: int = 256) -> Path:
    """DeepSeek-V3's MoE shape (58 MoE layers after one dense layer, 256 experts, top-8) with tiny
    tensors: the controller reads only its config and expert size. `experts`: routed experts per
    layer, more than DeepSeek-V3's for a group of more ranks than 256 (each rank holds one of its own)."""
    path = cache_dir() / ("standin-deepseek-v3-shape-v1" if experts == 256 else f"standin-deepseek-v3-shape-e{experts}")
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny("deepseek_v3", tmp, layers=59, hidden=8, experts=experts, top_k=8, heads=1, num_shards=1)
        os.replace(tmp, path)
    return path


def expert_checksum(layer: int, expert: int) -> int:
    """The checksum a stand-in reports for the weights of (layer, expert): the same on every rank
    and in every epoch, as a real expert's checksum is."""
    return zlib.crc32(f"{layer}/{expert}".encode())


@dataclass(frozen=True)
class StandInTiming:
    """step_s: a step's set time; jitter_s: up to this much more, drawn per rank and step;
    slow_s: rank_id -> extra time per step; epoch_s: time to form an epoch; start_s: from
    `StartWorker` to `WorkerHello` (a real rank loads its weights then); warm_slot_s: running one
    slot's new expert once (a grouped GEMM of one token and the first touch of its weights);
    a readiness-gate forward takes step_s."""

    step_s: float = 0.02
    jitter_s: float = 0.0
    slow_s: dict[int, float] = field(default_factory=dict)
    epoch_s: float = 0.005
    start_s: float = 0.1
    warm_slot_s: float = 0.0001


class Timers:
    """Callbacks due at monotonic times (one heap for the whole process)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, object]] = []
        self._ids = itertools.count()

    def at(self, when: float, callback) -> None:
        heapq.heappush(self._heap, (when, next(self._ids), callback))

    def next_in_s(self, now: float, most_s: float) -> float:
        return min(most_s, max(self._heap[0][0] - now, 0.0)) if self._heap else most_s

    def run_due(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, _, callback = heapq.heappop(self._heap)
            callback()


class LoadTemplates:
    """[L, E] int64 expert loads of a rank that runs n tokens (top-k routing spread over the experts),
    one per token count, shared by the ranks of the process."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.shape, self.top_k = (num_layers, num_experts), top_k
        self._cache: dict[int, np.ndarray] = {}
        self._rng = np.random.default_rng(0)

    def load(self, tokens: int) -> np.ndarray:
        out = self._cache.get(tokens)
        if out is None:
            num_layers, num_experts = self.shape
            picks = self._rng.integers(0, num_experts, size=(num_layers, tokens * self.top_k))
            out = np.stack([np.bincount(row, minlength=num_experts) for row in picks]).astype(np.int64)
            self._cache[tokens] = out
        return out

    def summed(self, steps: dict[int, int]) -> np.ndarray:
        """The [L, E] int32 load of steps of these token counts (tokens -> steps), or EMPTY_LOAD
        when it is all zeros, as a rank reports it."""
        if not steps:
            return EMPTY_LOAD
        total = sum(count * self.load(tokens) for tokens, count in steps.items())
        return total.astype(np.int32) if total.any() else EMPTY_LOAD


class StandInRank:
    """One rank: a step socket, its heartbeats (a schedule: it beats every interval from
    `first_beat`, until it is stopped), the epoch it is in and the slots it holds."""

    def __init__(self, agent: StandInAgent, rank_id: int, pid: int, join_mode: str):
        self.agent, self.rank_id, self.pid, self.join_mode = agent, rank_id, pid, join_mode
        self.alive, self.stopped = True, False
        self.epoch, self.members = -1, []
        self.slots: np.ndarray | None = None  # [L, slots_per_rank] experts it holds
        self.warm: np.ndarray | None = None  # [L, slots_per_rank] slots warm since filled (runtime/warmth.py)
        self.slot_maps = HeldSlotMaps(agent.host.slot_maps)  # the placements it confirmed last, as a worker's
        self.steps_run: set[tuple[int, int]] = set()  # the readiness gate's shapes it has run
        self.seq = 0
        self.progress = Progress()
        self.first_beat: float | None = None  # monotonic time of its first heartbeat (None: not beating)
        self.stopped_at = 0.0
        self.delay_s: dict[tuple[int, int], float] = {}  # (epoch, step) -> injected delay (ChaosStep)
        self.lose: set[tuple[int, int]] = set()  # (epoch, step) whose answer is lost on the way (ChaosStep)
        self.answer: StepResult | StepFailed | None = None  # of its last step, sent again on ResendResult
        self.answer_before: StepResult | StepFailed | None = None  # of the step before (serve --send-ahead-steps)
        self.pending: tuple[int, int] | None = None  # (epoch, step) of the step it has not answered yet
        # plans that came while a step ran (serve --send-ahead-steps), run in turn as a worker reads them
        self.queued: list[StepPlan] = []
        # tokens of a step -> steps that ran that many since the load was last reported: the load is
        # their templates summed when a plan asks for it, not an [L, E] array added per rank and step
        # (475 KB at 1,024 experts: a process of 256 stand-ins took ~1 s to start their first step)
        self.steps_since_report: dict[int, int] = {}
        self.plan_order = PlanOrder()
        self.relayed: list[StepPlan] = []  # plans its agent relayed while it was stopped: read when it resumes
        self.step_sock = None

    # ---- life --------------------------------------------------------------------------------

    def connect(self) -> None:
        launch, ctx = self.agent.launch, self.agent.ctx
        assert launch is not None
        self.step_sock = ctx.socket(zmq.DEALER)
        self.step_sock.setsockopt(zmq.IDENTITY, f"w{self.rank_id}".encode())
        self.step_sock.setsockopt(zmq.LINGER, 0)
        self.step_sock.connect(launch.step_addr)
        self.agent.host.register(self.step_sock, self)
        # a KV pool that holds every sequence it may get at full length (a real rank sizes it from memory)
        blocks = launch.max_num_seqs * -(-launch.max_model_len // launch.block_size)
        self.send(WorkerHello(self.rank_id, self.agent.node, self.pid, self.join_mode, "disk", 0.0, 0.0, "cpu",
                              blocks))
        self.progress = Progress()
        if launch.heartbeat_interval_s > 0:
            self.first_beat = time.monotonic() + random.random() * launch.heartbeat_interval_s

    def stop(self) -> None:
        """SIGSTOP: it reads nothing and sends nothing, beats no more; what arrives waits for SIGCONT."""
        if self.alive and not self.stopped:
            self.stopped, self.stopped_at = True, time.monotonic()
            if self.step_sock is not None:
                self.agent.host.unregister(self.step_sock)

    def resume(self) -> None:
        if self.alive and self.stopped:
            self.stopped = False
            if self.step_sock is not None:
                self.agent.host.register(self.step_sock, self)
            relayed, self.relayed = self.relayed, []
            for plan in relayed:
                self.plan_arrived(plan)

    def relay(self, plan: StepPlan) -> None:
        """Its plan out of the node's `NodeStepPlans` (its agent relays it); a stopped process reads it
        when it resumes."""
        if not self.alive:
            return
        if self.stopped:
            self.relayed.append(plan)
            return
        self.plan_arrived(plan)

    def plan_arrived(self, plan: StepPlan) -> None:
        """Run, hold or drop a plan of either path, as a real rank does (runtime/plan_order.py)."""
        if self.plan_order.admit(plan, self.epoch) == Verdict.RUN:
            self.plan_order.ran(plan)
            if self.pending is not None:
                self.queued.append(plan)
            else:
                self._step(plan)

    def close(self) -> None:
        if self.stopped:
            self.resume()
        self.alive = False
        if self.step_sock is not None:
            self.agent.host.unregister(self.step_sock)
            self.step_sock.close()
        self.step_sock = None

    def send(self, message) -> None:
        if self.alive and not self.stopped and self.step_sock is not None:
            self.agent.host.send(self.step_sock, self.agent.host.key.seal(message))

    def beat(self, now: float, interval_s: float) -> RankBeat | None:
        """Its last heartbeat as its agent heard it by `now`, with its age; None before its first."""
        first = self.first_beat
        if first is None or not self.alive:
            return None
        last = self.stopped_at if self.stopped else now
        if last < first:
            return None
        beat_at = last - (last - first) % interval_s  # it beats every interval_s from `first`
        return RankBeat(self.rank_id, self.pid, self.progress, round(now - beat_at, 4))

    def abort(self, epoch: int) -> None:
        """The agent relays the controller's `AbortEpoch`: a step of `epoch` it has not answered fails
        (collective), once it runs (a stopped process reads it when it resumes)."""
        if not self.alive:
            return
        if self.stopped:
            self.agent.host.timers.at(time.monotonic() + 0.01, lambda: self.abort(epoch))
            return
        if self.pending is not None and self.pending[0] == epoch:
            step = self.pending[1]
            self.pending = None
            self.answer_before, self.answer = self.answer, StepFailed(epoch, step, self.rank_id,
                                                                      "CollectiveError: the epoch was aborted")
            self.send(self.answer)
            self.queued = [q for q in self.queued if q.epoch != epoch]  # its group is gone: they never run

    def _resend(self, msg: ResendResult) -> None:
        """As a real rank: its kept answer when it is of (epoch, step), `StepFailed` NOT_RUN when it
        never got that plan; nothing while it still runs that step (it answers when done)."""
        if self.pending == (msg.epoch, msg.step) or any((q.epoch, q.step) == (msg.epoch, msg.step)
                                                         for q in self.queued):
            return
        for kept in (self.answer, self.answer_before):
            if kept is not None and (kept.epoch, kept.step) == (msg.epoch, msg.step):
                self.send(kept)
                return
        self.plan_order.passed(msg.epoch, msg.step)
        self.send(StepFailed(msg.epoch, msg.step, self.rank_id, f"never ran epoch {msg.epoch} step {msg.step} "
                             "(its plan did not arrive)", StepErrorKind.NOT_RUN))

    # ---- messages ----------------------------------------------------------------------------

    @staticmethod
    def inbox_kind(sock) -> str:
        return "worker"

    def on_message(self, sock, msg) -> None:
        if isinstance(msg, Shutdown):
            self.agent.rank_exited(self, 0)
        elif isinstance(msg, EpochStart):
            if msg.epoch > self.epoch:
                self._start_epoch(msg)
                for plan in self.plan_order.release(msg.epoch):
                    self.plan_arrived(plan)
        elif isinstance(msg, ChaosStep):
            self.delay_s[(msg.epoch, msg.step)] = msg.delay_s
            if msg.lose_result:
                self.lose.add((msg.epoch, msg.step))
        elif isinstance(msg, ResendResult):
            self._resend(msg)
        elif isinstance(msg, WarmUp):  # a step's time per forward, every slot computing
            if msg.epoch == self.epoch and self.slots is not None:
                self.steps_run |= set(zip(msg.shapes, msg.micro_batches, strict=True))
                warm_s = len(msg.shapes) * self.agent.timing.step_s
                self._send_in(msg.epoch, warm_s, self.agent.host.key.seal(
                    WarmedUp(msg.epoch, self.rank_id, list(msg.shapes), int(self.slots.size), warm_s)))
        elif isinstance(msg, StepPlan):
            self.plan_arrived(msg)
        elif isinstance(msg, SweepSlots):
            if msg.epoch == self.epoch and self.slots is not None:
                self.send(SlotChecksums(msg.epoch, self.rank_id, {
                    (layer, slot): expert_checksum(layer, int(self.slots[layer, slot])) for layer, slot in msg.slots}))

    def _start_epoch(self, msg: EpochStart) -> None:
        if msg.reuse_group and self.members != list(msg.members):
            self.send(EpochFailed(msg.epoch, self.rank_id, "asked to keep the epoch's group, which this rank no "
                                  "longer has"))
            return
        try:
            phy2log = self.slot_maps.resolve(msg.slot_map)
        except SlotMapUnusable as e:
            self.send(EpochFailed(msg.epoch, self.rank_id, str(e)))
            return
        self.epoch, self.members, self.seq, self.pending = msg.epoch, list(msg.members), 0, None
        self.queued, self.delay_s, self.lose = [], {}, set()
        self.progress = Progress(msg.epoch, -1, -1, "rendezvous", 0, time.time())
        s = msg.slots_per_rank
        self.slots = phy2log[:, self.rank_id * s:(self.rank_id + 1) * s]
        checksums = {(src.layer, src.slot): expert_checksum(src.layer, src.expert) for src in msg.sources}
        read = {(src.layer, src.expert): expert_checksum(src.layer, src.expert) for src in msg.sources
                if src.kind == "disk"}
        timing = self.agent.timing
        occupied = self.slots >= 0
        warmed = self.warm if self.warm is not None else np.zeros_like(occupied)
        cold = slots_to_warm(warmed, occupied, [(src.layer, src.slot) for src in msg.sources])
        self.warm = occupied & (warmed | cold)
        warm_s = int(cold.sum()) * timing.warm_slot_s
        stats = [TransferStat(kind, 0, timing.epoch_s) for kind in sorted({src.kind for src in msg.sources})]
        frames = self.agent.host.key.seal(EpochReady(msg.epoch, self.rank_id, checksums, read, stats, 0.0,
                                                     timing.epoch_s, 0.0, int(cold.sum()), round(warm_s, 4),
                                                     sorted(self.steps_run)))
        self._send_in(msg.epoch, timing.epoch_s + warm_s, frames, lambda: self.slot_maps.confirm(msg.epoch, phy2log))

    def _send_in(self, epoch: int, delay_s: float, frames, then: Callable[[], None] | None = None) -> None:
        """Send `frames` (an answer of `epoch`) after `delay_s`, unless it is gone or in another epoch
        by then, and call `then` once sent; a stopped process answers once it runs again."""
        def send() -> None:
            if not self.alive or self.epoch != epoch:
                return
            if self.stopped:
                self.agent.host.timers.at(time.monotonic() + 0.01, send)
                return
            self.progress = Progress(epoch, -1, -1, "idle", 0, time.time())
            self.agent.host.send(self.step_sock, frames)
            if then is not None:
                then()
        self.agent.host.timers.at(time.monotonic() + delay_s, send)

    def _step(self, plan: StepPlan) -> None:
        received = time.monotonic()
        timing = self.agent.timing
        due_s = timing.step_s + timing.slow_s.get(self.rank_id, 0.0) + self.delay_s.pop((plan.epoch, plan.step), 0.0)
        if timing.jitter_s:
            due_s += random.random() * timing.jitter_s
        self.seq += 1
        self.progress = Progress(plan.epoch, plan.step, 0, "dispatch", self.seq, time.time())
        tokens = {c.seq_id: self.agent.token(c.seq_id, c.start_pos + len(c.token_ids)) for c in plan.chunks
                  if c.sample}
        n_tokens = sum(len(c.token_ids) for c in plan.chunks)
        rows = plan.decode
        if rows is not None:  # decode rows: one token each, all sampling
            tokens.update((q, self.agent.token(q, p + 1)) for q, p in zip(rows.seq_ids, rows.positions, strict=True))
            n_tokens += len(rows.seq_ids)
        if n_tokens:
            self.steps_since_report[n_tokens] = self.steps_since_report.get(n_tokens, 0) + 1
        load = EMPTY_LOAD
        if plan.report_load:
            load, self.steps_since_report = self.agent.loads.summed(self.steps_since_report), {}
        self.pending = (plan.epoch, plan.step)

        def answer() -> None:
            if not self.alive or self.pending != (plan.epoch, plan.step):
                return
            if self.stopped:  # a stopped process answers once it runs again
                self.agent.host.timers.at(time.monotonic() + 0.01, answer)
                return
            self.pending = None
            step_s = time.monotonic() - received
            self.progress = Progress(plan.epoch, plan.step, -1, "idle", self.seq, time.time())
            self.answer_before, self.answer = self.answer, StepResult(
                plan.epoch, plan.step, self.rank_id, tokens, step_s, min(step_s, due_s), step_s - min(step_s, due_s),
                0.0, load, n_tokens * self.agent.top_k, {}, shape=n_tokens + plan.pad_tokens)
            if (plan.epoch, plan.step) not in self.lose:
                self.agent.step_result(self, self.answer)
            if self.queued:
                self._step(self.queued.pop(0))
        self.agent.host.timers.at(received + due_s, answer)


class StandInAgent:
    """One node: registers like `elastic-ep agent` and runs stand-in ranks for the controller."""

    def __init__(self, host: StandInHost, controller_addr: str, node: str, num_ranks: int, timing: StandInTiming,
                 lease_s: float = 5.0, hardware_interval_s: float = 1.0, step_results_via: str = "direct",
                 step_plans_via: str = "direct"):
        self.host, self.node, self.num_ranks, self.timing = host, node, num_ranks, timing
        self.ctx = host.ctx
        self.lease = Lease(lease_s)
        self.hardware_interval_s = hardware_interval_s
        self._hardware_at = 0.0
        self._node_beat_at = 0.0
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"a{node}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(controller_addr)
        host.register(self.sock, self)
        self.fetch_addr = f"tcp://127.0.0.1:{1 + zlib.crc32(node.encode()) % 60000}"  # never fetched from
        self.launch: WorkerLaunch | None = None
        self.ranks: dict[int, StandInRank] = {}  # rank_id -> its running stand-in
        self.loads: LoadTemplates | None = None
        self.top_k, self.vocab, self.eos = 1, 2, ()
        self.stopped = False
        self.gather = StepGather() if step_results_via == "agent" else None
        self._gather_at = 0.0  # when the gather's pending timer fires (0: none pending)
        self.relays_plans = step_plans_via == "agent"
        self.plan_sock = None  # --step-plans-via agent: connected to the controller's plan socket once welcomed

    def step_result(self, rank: StandInRank, result: StepResult) -> None:
        """A rank's answer: to the controller by the rank itself (direct), or held in this node's
        gather and forwarded with the others of its step (agent)."""
        if self.gather is None:
            rank.send(result)
            return
        self.gather.add(result, time.monotonic())
        self._forward_results()

    def _forward_results(self) -> None:
        now = time.monotonic()
        if self._gather_at and now >= self._gather_at:
            self._gather_at = 0.0
        for results in self.gather.due(now, list(self.ranks)):
            self.send(node_results(self.node, self.lease.session, results))
        wait_s = self.gather.next_due_s(now)
        if wait_s is not None and not self._gather_at:
            self._gather_at = now + wait_s
            self.host.timers.at(self._gather_at, self._forward_results)

    def token(self, seq_id: int, position: int) -> int:
        """A deterministic token that is never EOS, so sequences run to max_tokens."""
        t = 2 + (seq_id * 7919 + position * 104729) % (self.vocab - 2)
        return t if t not in self.eos else 2

    def tick(self, now: float) -> None:
        if self.stopped:
            return
        if self.lease.hello_due(now):
            self.send(AgentHello(self.node, os.getpid(), self.fetch_addr, 1 << 40, self.num_ranks, "initial",
                                 False, self.lease.session, "127.0.0.1", True))
        interval_s = self.launch.heartbeat_interval_s if self.launch is not None else 0.0
        if self.lease.alive_due(now, interval_s):
            self.send(AgentAlive(self.node, self.lease.session))
        if self.lease.welcomed and now - self._hardware_at >= self.hardware_interval_s:
            self._hardware_at = now
            self.send(HardwareReport(self.node, 0.0, None, [], {"nvml": "stand-in node", "xid": "stand-in node"}))
        if self.lease.welcomed and interval_s > 0 and now - self._node_beat_at >= interval_s:
            self._node_beat_at = now
            beats = [b for rank in self.ranks.values() if (b := rank.beat(now, interval_s)) is not None]
            if beats:
                self.send(NodeHeartbeat(self.node, self.lease.session, beats))
                self.lease.node_beat_sent(now)

    def send(self, message) -> None:
        self.host.send(self.sock, self.host.key.seal(message))

    def inbox_kind(self, sock) -> str:
        return "plans" if sock is self.plan_sock else "agent"

    def on_message(self, sock, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, NodeStepPlans):
            for rank_id, rank in list(self.ranks.items()):
                plan = msg.plan_of(rank_id)
                if plan is not None:
                    rank.relay(plan)
        elif isinstance(msg, AgentWelcome):
            if self.lease.welcome(msg.session, now):
                self._welcomed(msg.launch)
        elif isinstance(msg, LeaseRenew):
            self.lease.renew(msg.session, now)
        elif isinstance(msg, SessionEnded) and msg.session == self.lease.session:  # not an older session's
            for rank in list(self.ranks.values()):
                self.rank_exited(rank, -9)
            self.lease.restart()
        elif isinstance(msg, AgentShutdown):
            self.shutdown()
        elif isinstance(msg, StartWorker):
            self._start(msg.rank_id, msg.join_mode)
        elif isinstance(msg, FenceWorker):
            rank = self.ranks.get(msg.rank_id)
            if rank is not None and rank.pid == msg.pid:
                self.ranks.pop(msg.rank_id)
                rank.close()
            self.send(WorkerFenced(self.node, msg.rank_id, msg.pid))
        elif isinstance(msg, SignalWorker):
            self._signal(msg)
        elif isinstance(msg, AbortEpoch):
            for rank_id in msg.rank_ids:
                if (rank := self.ranks.get(rank_id)) is not None:
                    rank.abort(msg.epoch)
        elif isinstance(msg, BackupAssign):
            site = BackupSite(self.node, f"/dev/shm/standin-{self.node}", self.fetch_addr)
            self.send(BackupReady(self.node, site, list(msg.items), 0, len(msg.items),
                                  [expert_checksum(layer, expert) for layer, expert in msg.items],
                                  self.lease.session))

    def _welcomed(self, launch: WorkerLaunch) -> None:
        self.launch = launch
        if self.relays_plans and self.plan_sock is None and launch.plan_addr:
            self.plan_sock = self.ctx.socket(zmq.DEALER)
            self.plan_sock.setsockopt(zmq.IDENTITY, f"p{self.node}".encode())
            self.plan_sock.setsockopt(zmq.LINGER, 0)
            self.plan_sock.connect(launch.plan_addr)
            self.host.register(self.plan_sock, self)
        config, self.loads = self.host.model(launch.model_dir)
        self.top_k, self.vocab, self.eos = config.top_k, config.vocab_size, tuple(config.eos_token_ids)

    def _start(self, rank_id: int, join_mode: str) -> None:
        pid = PID_BASE + rank_id * 1000 + next(self.host.incarnations) % 1000
        rank = StandInRank(self, rank_id, pid, join_mode)
        old = self.ranks.pop(rank_id, None)
        if old is not None:
            old.close()
        self.ranks[rank_id] = rank
        self.send(WorkerStarted(self.node, rank_id, pid, self.lease.session))
        # its hello after its start report, as a real rank's comes seconds after it
        self.host.timers.at(time.monotonic() + self.timing.start_s, lambda: rank.alive and rank.connect())

    def _signal(self, msg: SignalWorker) -> None:
        rank = self.ranks.get(msg.rank_id)
        if rank is None or rank.pid != msg.pid:
            return
        if msg.signal in (signal.SIGKILL, signal.SIGTERM):
            self.rank_exited(rank, -msg.signal)
        elif msg.signal == signal.SIGSTOP:
            rank.stop()
        elif msg.signal == signal.SIGCONT:
            rank.resume()

    def rank_exited(self, rank: StandInRank, returncode: int) -> None:
        """The rank's process is gone: its messages stop, and this agent reports the exit."""
        if self.ranks.get(rank.rank_id) is rank:
            del self.ranks[rank.rank_id]
        rank.close()
        self.send(WorkerExited(self.node, rank.rank_id, rank.pid, returncode))

    def shutdown(self) -> None:
        if self.stopped:
            return
        for rank in list(self.ranks.values()):
            rank.close()
        self.ranks.clear()
        self.send(AgentBye(self.node, self.lease.session))
        self.stopped = True


class StandInHost:
    """One process of stand-in nodes: its sockets watched with epoll, timers, one thread.

    Not `zmq.Poller`: a poll asks every socket for its events (ZMQ_EVENTS), ~20 us each on a loaded
    host, and a process of 256 stand-in ranks has 512 sockets and wakes for a timer every fraction
    of a millisecond, so polling alone took a core (a poll of 512 sockets took 12 ms on a loaded
    2-core host) and the ranks' heartbeats and the agents' alives went out seconds late. ZeroMQ's
    notification fd of a socket (ZMQ_FD) wakes epoll when its state may have changed; the socket is
    then read until it has nothing, and after it sent (which may consume the notification) it is
    read again."""

    def __init__(self, key: ClusterKey) -> None:
        self.key = key
        self.inboxes = {kind: Inbox(f"standin_{kind}", accepts, key) for kind, accepts in (
            ("agent", CONTROLLER_TO_AGENT), ("worker", CONTROLLER_TO_WORKER), ("plans", RELAYED_TO_WORKER))}
        self.ctx = zmq.Context.instance()
        self.epoll = select.epoll()
        self.owners: dict[zmq.Socket, object] = {}
        self.by_fd: dict[int, zmq.Socket] = {}
        self.unread: set[zmq.Socket] = set()  # may hold messages without a new notification
        self.timers = Timers()
        self.incarnations = itertools.count()
        self.agents: list[StandInAgent] = []
        self.slot_maps = SharedSlotMaps()  # the placements its ranks hold, one array each, not one per rank
        self._models: dict[str, tuple[MoEConfig, LoadTemplates]] = {}

    def model(self, model_dir: str) -> tuple[MoEConfig, LoadTemplates]:
        """The model's config and load templates, read once per process (a slow read would silence
        every agent of the process, and the controller drops an agent silent for --agent-timeout-s)."""
        if model_dir not in self._models:
            config = MoEConfig.from_pretrained(model_dir)
            self._models[model_dir] = config, LoadTemplates(len(config.moe_layers), config.num_experts, config.top_k)
        return self._models[model_dir]

    def register(self, sock, owner) -> None:
        if sock not in self.owners:
            fd = sock.getsockopt(zmq.FD)
            self.by_fd[fd] = sock
            self.epoll.register(fd, select.EPOLLIN)
        self.owners[sock] = owner
        self.unread.add(sock)  # what arrived while it was not watched raised no notification

    def unregister(self, sock) -> None:
        if self.owners.pop(sock, None) is not None:
            fd = sock.getsockopt(zmq.FD)
            self.by_fd.pop(fd, None)
            self.epoll.unregister(fd)
        self.unread.discard(sock)

    def send(self, sock, frames: list[bytes]) -> None:
        sock.send_multipart(frames)
        self.unread.add(sock)

    def run(self, stop_when_idle: bool = True) -> None:
        """Until every agent was told to shut down (or SIGTERM)."""
        while not (stop_when_idle and self.agents and all(a.stopped for a in self.agents)):
            now = time.monotonic()
            for agent in self.agents:
                agent.tick(now)
            self.timers.run_due(now)
            wait_s = 0.0 if self.unread else self.timers.next_in_s(time.monotonic(), 0.02)
            woken = {self.by_fd[fd] for fd, _ in self.epoll.poll(wait_s) if fd in self.by_fd}
            check, self.unread = woken | self.unread, set()
            for sock in check:
                owner = self.owners.get(sock)
                while owner is not None and self.owners.get(sock) is owner:  # a message may close it
                    try:
                        frames = recv_parts(sock, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = self.inboxes[owner.inbox_kind(sock)].read(frames)
                    if msg is not None:
                        owner.on_message(sock, msg)
            self.timers.run_due(time.monotonic())


def _end(*_) -> None:
    """SIGTERM: exit, once. A second one (the parent's death signal while this process is already
    exiting) raised in the interpreter's exit handlers, a traceback on stderr for nothing."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(0)


def parse_slow(items: list[str]) -> dict[int, float]:
    """["3:20", ...] -> {3: 0.02}: rank 3 takes 20 ms more per step."""
    out = {}
    for item in items:
        rank, _, ms = item.partition(":")
        out[int(rank)] = float(ms) / 1000
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_ep.harness.standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--controller", required=True, help="the controller's health socket (tcp://host:port)")
    parser.add_argument("--node", action="append", required=True, help="a stand-in node (repeat)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=20.0, help="a step's set time")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="up to this much more per rank and step")
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:MS", help="a rank's extra time per step")
    parser.add_argument("--warm-slot-ms", type=float, default=StandInTiming.warm_slot_s * 1000,
                        help="running one newly filled slot once before the epoch serves")
    parser.add_argument("--lease-s", type=float, default=5.0)
    parser.add_argument("--step-results-via", choices=["direct", "agent"], default="direct",
                        help="each rank's results to the controller, or its node's gathered by its agent")
    parser.add_argument("--step-plans-via", choices=["direct", "agent"], default="direct",
                        help="each rank's plans from the controller, or its node's in one frame through its agent")
    parser.add_argument("--model", default=None, help="the served checkpoint dir, read before registering")
    parser.add_argument("--cluster-key-file", default=None,
                        help="the deployment's cluster key (as `elastic-ep agent`; default $ELASTIC_EP_CLUSTER_KEY)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _end)
    end_with_parent(signal.SIGTERM)  # the stand-ins end with whoever started them, as real ranks with their agent
    host = StandInHost(ClusterKey.read(args.cluster_key_file) if args.cluster_key_file else key_from_env())
    if args.model:
        host.model(args.model)
    timing = StandInTiming(args.step_ms / 1000, args.jitter_ms / 1000, parse_slow(args.slow),
                           warm_slot_s=args.warm_slot_ms / 1000)
    host.agents = [StandInAgent(host, args.controller, node, args.ranks_per_node, timing, args.lease_s,
                                step_results_via=args.step_results_via, step_plans_via=args.step_plans_via)
                   for node in args.node]
    try:
        host.run()
    finally:
        for agent in host.agents:
            agent.shutdown()
        time.sleep(0.1)  # let the byes go out
        host.ctx.destroy(linger=0)  # an open socket would hold the interpreter's exit forever
    return 0


if __name__ == "__main__":
    sys.exit(main())
