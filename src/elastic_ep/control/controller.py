"""The controller: the one control thread that ties the roles together, at the top of control/.

It owns every socket (`ControlPlane`) and the cluster state (`ClusterState`), builds each role
with the narrow view and callables it uses, and alternates between the step loop and handling
what arrives. At each step boundary it decides, in order: recover (pending faults), move a scale
on, admit registered ranks (rejoin) up to the target size (the rest stand by), keep the standby
ranks, refill slots that failed their check, act on stragglers, move experts towards balance
(after a recovery or rejoin, or for EPLB), check a few slots in the background, run a step.
Every wait anywhere (a step, a fence, an epoch forming) goes through `pump`, which keeps
heartbeats, agent reports and HTTP commands flowing and runs the detector; a fault found while
waiting ends the wait with `RecoveryNeeded`, and the loop recovers.

Where the roles live (docs/ARCHITECTURE.md walks a request and a fault through them):
`serving/` (scheduler, DP alignment, step loop, streams, isolation, recorder), `faults/`
(detector and its rules, recovery, the straggler policy), `epochs/` (epoch requests, the
epoch change, slot checks, the background rebalance and its rules), `membership/` (nodes,
standbys, scaling rules and driver, backups, hardware signals), `facade/` (the engine the HTTP
thread calls, its commands, what is published), and `chaos.py` (installed only with
--enable-chaos).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from elastic_ep.errors import ElasticEPError, PlacementError
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.read_throttle import create_rate_file
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import (
    AgentAlive,
    AgentBye,
    AgentHello,
    BackupReady,
    ChaosFailed,
    ClusterKey,
    EpochFailed,
    EpochReady,
    HardwareReport,
    NodeHeartbeat,
    NodeStepResults,
    SleepReply,
    SlotChecksums,
    StepFailed,
    StepResult,
    WarmedUp,
    WorkerExited,
    WorkerFenced,
    WorkerHello,
    WorkerStarted,
    WorkerStartFailed,
)

from .api import EngineInfo, ScaleRejected
from .chaos import ChaosInjector
from .cluster import ClusterState
from .cold_start import TimeToReady
from .config import ServeConfig, check_config
from .control_plane import ControlPlane, Inbound
from .epochs.background_rebalance import BackgroundRebalance
from .epochs.epoch_change import (
    EpochChanger,
    EpochReport,
    Formed,
    Interrupted,
    NoPlacement,
    NotFormed,
    VerifyFailed,
)
from .epochs.requests import Adopt, EpochRequest, Recover, Refill, Rejoin, Start, holding_of
from .epochs.slot_check import SlotSweeper
from .events import EventKind
from .facade.engine import EngineFacade, Published
from .facade.publisher import Publisher
from .facade.to_loop import (
    AbortRequest,
    AbortRollout,
    AddRequest,
    Command,
    Sleep,
    StartDrain,
    StartRollout,
    StartScale,
    Uncordon,
    WakeUp,
)
from .faults.detector import Fault, FaultDetector, RecoveryNeeded, superseded_node_beats
from .faults.recovery import Recovery
from .faults.straggler_control import StragglerControl
from .membership.adoption import Adoption, adoption_plan, cordoned_nodes
from .membership.hardware import HardwareSignals
from .membership.nodes import Nodes
from .membership.rolling_restart import RollingRestart
from .membership.scale_driver import ScaleDriver
from .membership.standbys import Standbys
from .metrics import ClusterMetrics, RejectedFrames
from .ranks import RankStatus
from .serving.adopted_kv import KV_HOLD_S
from .serving.alignment import AlignRule
from .serving.isolation import Isolation
from .serving.recorder import ExpertRecorder
from .serving.scheduler import Scheduler
from .serving.sleep_mode import SleepMode
from .serving.step_loop import StepLoop
from .serving.streams import Streams
from .serving.warmup import WarmUpGate, warmup_shapes
from .tracing import RequestTraces

logger = logging.getLogger(__name__)
SNAPSHOT_HOLD_S = 2.0  # after a fault, how long a throttled /cluster snapshot may wait for the first step


def _start_tracing(cfg: ServeConfig) -> RequestTraces:
    """Request traces to --otlp-traces-endpoint: OpenTelemetry is imported here, only with the flag."""
    try:
        from .otel import OtelSink
    except ImportError as e:
        raise ElasticEPError(f"--otlp-traces-endpoint needs OpenTelemetry ({e}): "
                             "pip install 'elastic-ep[tracing]'") from e
    return RequestTraces(OtelSink.to_endpoint(cfg.otlp_traces_endpoint, model_name=cfg.model_name),
                         cfg.trace_sample_ratio)


def store_on(host: str, timeout_s: float = 30.0) -> dist.TCPStore:
    """The rendezvous store, listening on `host` only: TCPStore binds every interface when it
    makes its own socket, and it cannot authenticate a client (docs/RUNBOOK.md: firewall it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(512)
    port = listener.getsockname()[1]
    # the store serves on this socket from now on: it owns the descriptor
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                         master_listen_fd=listener.detach())


class Controller:
    """Start with `start()`, stop with `stop()`; the HTTP app talks to `engine`. `key`: the
    deployment's cluster key, which every agent and worker must hold; `term`: the term this
    controller leads its group in (serve --etcd; 0 alone), the fencing token of every frame it sends."""

    def __init__(self, cfg: ServeConfig, key: ClusterKey, registry: CollectorRegistry | None = None, term: int = 0):
        self.cfg = cfg
        self.config = MoEConfig.from_pretrained(cfg.model_dir)
        self.reader = CheckpointReader(cfg.model_dir, self.config, dtype=cfg.dtype)
        self.redundancy = check_config(cfg, self.config, self.reader.expert_nbytes)
        slots_per_rank = self.redundancy.slots_per_rank
        logger.info("%s", self.redundancy.describe())
        if self.redundancy.survives.rank_losses == 0 and cfg.ep_size > 1:
            logger.warning("with %s redundant expert slots the group cannot hold every expert once it loses a rank: "
                           "any loss waits for the rank to restart (--redundant-experts auto outlives one)",
                           self.redundancy.redundant_experts)
        num_layers = len(self.config.moe_layers)
        registry = registry or CollectorRegistry()
        nbytes = self.reader.expert_nbytes
        self.metrics = ClusterMetrics(registry, cfg.model_name, cfg.metrics_top_k)
        self.rejected_frames = RejectedFrames(registry)
        self.scheduler = Scheduler(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   AlignRule(cfg.dp_align, cfg.dp_align_min_chunk, cfg.dp_migrate,
                                             cfg.dp_migrate_patience), cfg.reprefill_tokens_per_step,
                                   block_size=cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                                   prefix_wait=cfg.prefix_wait)
        self.cluster = c = ClusterState(num_layers, self.config.num_experts, slots_per_rank)
        self.ready_clock = TimeToReady()
        registry.register(c.loads)
        registry.register(self.ready_clock)
        # the storage throttle's shared file (model/read_throttle.py), removed when the loop ends
        self.read_rate_path = create_rate_file() if cfg.load_read_rate_mb_s > 0 else ""
        self.recorder = ExpertRecorder(num_layers, self.config.num_experts, self.config.moe_layers)
        self.traces = _start_tracing(cfg) if cfg.otlp_traces_endpoint else None
        self.streams = Streams(self.scheduler, self.traces)
        self.detector = FaultDetector(cfg)
        self.plane = ControlPlane(cfg.control_host, key, term)
        self.store = store_on(cfg.control_host)
        self.store_port = self.store.port
        self.changer = EpochChanger(c, cfg, self.plane, self.store, nbytes, self.pump,
                                    lambda ranks: any(r in self.detector.faults for r in ranks))
        self.nodes = Nodes(c, cfg, self.plane, self.store_port, nbytes, fault=self.fault,
                           target_size=lambda: self.scaling.target_ep_size, undrain=self.scheduler.undrain,
                           forget_measures=self._forget_measures, pump=self.pump,
                           publish=lambda: self.publish(throttle_s=0.25),
                           set_pool_size=self.scheduler.set_pool_size, read_rate_path=self.read_rate_path)
        self.chaos = (ChaosInjector(c, self.plane, self.nodes, self.changer.after_next_start, self.scheduler.by_id)
                      if cfg.enable_chaos else None)
        self.isolation = Isolation(self.streams, c.events, self.fault, cfg.isolation_max_steps)
        self.warmup = WarmUpGate(c, self.plane, warmup_shapes(cfg.max_num_seqs, cfg.max_num_batched_tokens),
                                 cfg.epoch_timeout_s, self.pump, lambda ranks: any(r in self.detector.faults
                                                                                   for r in ranks),
                                 cfg.dbo_min_tokens if cfg.enable_dbo else None)
        self.steps = StepLoop(c, cfg, self.plane, self.scheduler, self.detector, self.metrics, self.recorder,
                              self.streams, self.isolation, self.config.top_k, self.pump, self.chaos,
                              traces=self.traces, warmup=self.warmup if cfg.warmup_gate else None,
                              during_step=self._housekeep)
        self._joinable = False  # `_housekeep` found ranks outside the group that could join
        self.standby = Standbys(c, cfg.standby_ranks, self.nodes, target_size=lambda: self.scaling.target_ep_size,
                                joiner=lambda r: self.scaling.joiner(r), faulted=lambda r: r in self.detector.faults)
        self.scaling = ScaleDriver(c, cfg, self.nodes, self.scheduler,
                                   take_standbys=lambda n: self.standby.ready()[:n], joiners=self.joiners,
                                   form=self.form, publish=self.publish,
                                   ended=lambda result: self.metrics.scale_operations.labels(result).inc())
        self.rollout = RollingRestart(c, cfg, self.scaling, self.nodes, standbys=self.standby.ready,
                                      check_model=self._check_model, publish=self.publish)
        self.sleep = SleepMode(c, self.plane, self.metrics.engine_sleep_state, busy=self._sleep_blocker,
                               publish=self.publish)
        self.hardware = HardwareSignals(registry, c.events)
        self.stragglers = StragglerControl(
            c, cfg, self.steps.own_time, standbys=lambda: len(self.standby.ready()), fault=self.fault,
            replace_later=self.standby.replace_later, pending=lambda: self.detector.pending,
            evidence=self.hardware.evidence, load=self.load, form=self.form, recovering=lambda: self.recovery.open,
            compute=self.changer.ahead.submit)
        self.sweeper = SlotSweeper(c, cfg, self.plane, self.changer)
        self.rebalancer = BackgroundRebalance(
            c, cfg, nbytes, self.metrics, load=self.load, load_steps=lambda: len(self.steps.load_window),
            speeds=self.stragglers.placement_speeds, form=self.form, scaling=lambda: self.scaling.active,
            has_work=lambda: self.scheduler.has_work, recovering=lambda: self.recovery.open,
            compute=self.changer.ahead.submit)
        self.recovery = Recovery(
            c, cfg, self.detector, self.metrics, self.steps, self.scheduler, self.streams, self.scaling, self.nodes,
            self.rebalancer, pump=self.pump, fault=self.fault, joiners=self.joiners, form=self.form,
            leave=self.changer.leave, reset_isolation=self.isolation.reset, publish=self.publish,
            traces=self.traces)
        self.published = Published()
        self._commands: queue.Queue[Command] = queue.Queue()
        info = EngineInfo(cfg.model_name, cfg.max_model_len, tuple(self.config.eos_token_ids))
        self.engine = EngineFacade(cfg, info, self.recorder, self.published, self._send)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_fatal = None  # called from the control thread when the loop dies
        self.adoption: Adoption | None = None  # a new leader's takeover of the running ranks (`adopt`)
        self.publisher = Publisher(c, cfg, self.detector, self.steps, self.scheduler, self.published, self.metrics,
                                   heard=self.plane.heard_clock, controller_addr=self.plane.health_addr,
                                   views=self._views, slow_delays=self.chaos.slow_delays if self.chaos else dict,
                                   derated=self.stragglers.derated, times=self.plane.times)
        self.publish()

    @property
    def health_addr(self) -> str:
        """Where agents connect (`elastic-ep agent --controller`)."""
        return self.plane.health_addr

    @property
    def fatal(self) -> str | None:
        return self.published.fatal

    # ---- lifecycle -------------------------------------------------------------------------

    def set_term(self, term: int) -> None:
        """Lead in `term` from now on (serve --etcd builds its controller while it stands by, then
        sets the term it won before `start`): every frame sent carries it."""
        self.plane.term = term

    def adopt(self, record: dict[str, Any] | None, journaled: Iterable[str] = ()) -> None:
        """Before `start`, in a new leader of a group: take over the ranks of the last leader's cluster
        record `record` as they run (membership/adoption.py) instead of starting ranks, and the KV they
        hold for the last leader's unfinished requests `journaled` (their ids; serving/adopted_kv.py);
        nothing to adopt (no record, no epoch formed) starts as usual. The nodes the record has
        cordoned stay cordoned either way (a drained node takes no rank until POST /uncordon)."""
        self.cluster.cordoned.update(cordoned_nodes(record))
        plan = adoption_plan(record)
        self.adoption = Adoption(plan, self.cluster, self.cfg, self.nodes, self.pump, set(journaled)) if plan else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="control-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut down workers (via agents) and the control loop."""
        self._stopping.set()
        self.plane.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _send(self, command: Command) -> None:
        self._commands.put(command)
        self.plane.wake()

    def _run(self) -> None:
        try:
            try:
                if self.adoption is not None:
                    self.adoption.wait(self._stopping)
                    self.detector.clear()
                    if not self._stopping.is_set():
                        self._adopt(self.adoption)
                else:
                    self.nodes.wait_for_ranks(self._stopping)
                    self.ready_clock.mark("ranks_registered_s")
                    self.detector.clear()
                    if not self._stopping.is_set():  # stopped while waiting: there is nothing to start
                        self._start()
            except RecoveryNeeded:
                pass
            while not self._stopping.is_set():
                try:
                    if self.detector.pending:
                        self.recovery.run()
                    else:
                        self._iterate()
                except RecoveryNeeded:
                    continue
        except Exception as e:  # the loop must not die silently: readiness says why
            fatal = f"{type(e).__name__}: {e}"
            self.cluster.set_readiness(False, f"control loop failed: {fatal}")
            self.cluster.events.add(EventKind.FATAL, fatal)
            self.published.fatal = fatal
            self.publish()
            if self.on_fatal is not None:
                self.on_fatal()
            if not isinstance(e, ElasticEPError):  # a bug: its traceback too; a stated reason is enough otherwise
                raise
        finally:
            self.nodes.shutdown()
            self.changer.ahead.close()
            if self.read_rate_path:
                os.unlink(self.read_rate_path)
            if self.traces is not None:
                self.traces.sink.shutdown()  # flush what is sampled
            self.streams.end_all("server shutting down")
            time.sleep(0.1)

    # ---- waiting -----------------------------------------------------------------------------

    def pump(self, timeout_s: float, snapshot: bool = True) -> None:
        """Wait up to timeout_s for input, handle everything that arrived, run the detector, publish
        (readiness and health; the /cluster snapshot when due, unless `snapshot` is False)."""
        times = self.plane.times
        received = self.plane.receive(timeout_s)
        heard = self.plane.heard_clock()  # when all of these were read: one clock read for the batch
        superseded = superseded_node_beats([inbound.message for inbound in received])
        for k, inbound in enumerate(received):
            if k in superseded:  # an agent's newer NodeHeartbeat in this batch dates its ranks
                continue
            t0 = time.perf_counter()
            self._dispatch(inbound, heard)
            kind = type(inbound.message).__name__
            times.handled_s[kind] += time.perf_counter() - t0
            times.handled[kind] += 1
        self._run_commands()
        heard = self.plane.heard_clock()
        c = self.cluster
        t0 = time.perf_counter()
        for fault in self.detector.check(heard, c.ranks, c.members, bool(self.steps.in_step), c.epoch):
            self.fault(fault)
        self.nodes.check_agents(heard)
        self.nodes.restart_due(time.monotonic())
        t1 = time.perf_counter()
        self.publish(throttle_s=0.25, snapshot=snapshot)
        times.handled_s["(detector)"] += t1 - t0
        times.handled_s["(publish)"] += time.perf_counter() - t1

    def _dispatch(self, inbound: Inbound, heard: float) -> None:
        """Hand one message to its role; `heard`: the heard clock when it was read."""
        msg, nodes = inbound.message, self.nodes
        if isinstance(msg, NodeHeartbeat):
            if nodes.on_node_heartbeat(msg, heard):  # not of a session given up on
                taken = self.detector.node_heartbeat(self.cluster.ranks, msg, self.cluster.epoch, heard)
                self.metrics.rank_heartbeats.labels(msg.node).inc(taken)
        elif isinstance(msg, AgentAlive):
            nodes.on_agent_alive(inbound.identity, msg)
            agent = self.cluster.agents.get(msg.node)
            if agent is not None and agent.standalone and agent.session == msg.session:
                # an agent of its own process; one in this process is counted by this process itself
                self.rejected_frames.report(msg.node, msg.frames_rejected)
        elif isinstance(msg, StepResult | StepFailed):
            self.steps.on_reply(msg)
        elif isinstance(msg, NodeStepResults):
            self.steps.on_node_results(msg)
        elif isinstance(msg, EpochReady | EpochFailed):
            self.changer.on_reply(msg)
            r = self.cluster.ranks.get(msg.rank_id)
            if isinstance(msg, EpochReady) and r is not None:
                self.cluster.loads.transfers(r.node, msg.transfers)
            if isinstance(msg, EpochFailed) and msg.unreachable_node:
                nodes.drop_backup(msg.unreachable_node, "its agent does not answer")
        elif isinstance(msg, SlotChecksums):
            self.sweeper.on_checksums(msg)
        elif isinstance(msg, WarmedUp):
            self.warmup.on_reply(msg)
        elif isinstance(msg, SleepReply):
            self.sleep.on_reply(msg)
        elif isinstance(msg, WorkerHello):
            nodes.on_worker_hello(msg)
        elif isinstance(msg, WorkerStarted):
            nodes.on_worker_started(inbound.identity, msg)
        elif isinstance(msg, WorkerExited):
            nodes.on_worker_exited(msg)
        elif isinstance(msg, WorkerStartFailed):
            nodes.on_worker_start_failed(msg)
        elif isinstance(msg, WorkerFenced):
            nodes.on_worker_fenced(msg)
        elif isinstance(msg, AgentHello):
            nodes.on_agent_hello(inbound.identity, msg)
        elif isinstance(msg, AgentBye):
            nodes.on_agent_bye(msg)
        elif isinstance(msg, BackupReady):
            nodes.on_backup_ready(msg)
            self.changer.add_references(msg.experts, msg.checksums)
        elif isinstance(msg, HardwareReport):
            self.hardware.on_report(msg)
        elif isinstance(msg, ChaosFailed):
            self.cluster.events.add(EventKind.CHAOS, f"node {msg.node} could not inject the fault: {msg.reason}",
                                    node=msg.node)

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            self._run_command(cmd)

    def _run_command(self, cmd: Command) -> None:
        if isinstance(cmd, AddRequest):
            self.streams.add(cmd.seq.seq_id, cmd.stream)
            self.scheduler.add(cmd.seq)
            if self.traces is not None:
                self.traces.arrived(cmd.seq.seq_id, cmd.seq.request.request_id, len(cmd.seq.request.prompt_token_ids))
        elif isinstance(cmd, AbortRequest):
            self.scheduler.abort(cmd.seq_id)
            self.streams.drop(cmd.seq_id)
            if self.traces is not None:
                self.traces.finished(cmd.seq_id, "abort")
        elif isinstance(cmd, StartScale | StartDrain | Uncordon | StartRollout | AbortRollout | Sleep | WakeUp):
            try:
                if isinstance(cmd, Sleep):
                    self.sleep.sleep(cmd.level, cmd.reply)
                    return  # answered once every rank did
                if isinstance(cmd, WakeUp):
                    self.sleep.wake(cmd.reply)
                    return
                if self.sleep.blocks_steps and not isinstance(cmd, Uncordon):
                    raise ScaleRejected("the engine is asleep; POST /wake_up first", 409)
                if isinstance(cmd, StartScale | StartDrain) and self.rollout.active:
                    raise ScaleRejected(self.rollout.busy(), 409)
                if isinstance(cmd, StartRollout):
                    answer = self.rollout.request(cmd.options)
                elif isinstance(cmd, AbortRollout):
                    answer = self.rollout.abort()
                elif isinstance(cmd, StartScale):
                    answer = self.scaling.request(cmd.new_ep_size, cmd.ranks)
                elif isinstance(cmd, StartDrain):
                    answer = self.scaling.drain(cmd.ranks, cmd.node)
                else:
                    answer = self.scaling.uncordon(cmd.node)
            except ScaleRejected as e:
                cmd.reply.set_exception(e)
                return
            self.publish()  # before the answer: the caller's next /is_scaling_elastic_ep sees the scale
            cmd.reply.set_result(answer)
        elif self.chaos is not None:  # the facade refuses chaos orders without --enable-chaos
            self.chaos.run(cmd)

    # ---- faults and epochs -----------------------------------------------------------------

    def fault(self, fault: Fault) -> None:
        """Route a detected fault: a joiner of the scale in flight fails that scale; a standby is
        replaced; a live rank is kept for recovery (once)."""
        r = self.cluster.ranks[fault.rank_id]
        if fault.rank_id in self.detector.faults or r.status.down or r.status == RankStatus.RETIRING:
            return
        if self.scaling.joiner(fault.rank_id) and fault.rank_id not in self.cluster.members:
            self.scaling.fail(f"joining rank {fault.rank_id} failed: {fault.detail}")
            return
        if r.status == RankStatus.STANDBY:
            self.standby.lost(fault.rank_id, fault.detail)
            return
        self.detector.record(fault)
        if self.sleep.blocks_steps:
            self.sleep.abandon(f"rank {fault.rank_id} failed ({fault.detail})")
        self.cluster.events.add(EventKind.FAULT, f"rank {fault.rank_id}: {fault.detail}", fault.rank_id,
                                cause=fault.detail, signal=fault.cause.value)

    def form(self, request: EpochRequest, reason: str) -> EpochReport | NoPlacement:
        """The epoch `request` asks for, applied once formed (the scheduler serves on its holding
        ranks, readiness, metrics, the `epoch` event, the backup after the first). Returns its
        report, or `NoPlacement` for the caller to handle. An epoch that did not form leaves its
        culprits (or an error) with the detector and raises RecoveryNeeded: recovery takes it."""
        c = self.cluster
        first = c.location is None and not isinstance(request, Adopt)  # adopted ranks are warm, their backup held
        self.detector.new_epoch()
        started_s = time.monotonic()
        outcome = self.changer.change(request, self.load())
        if isinstance(outcome, NoPlacement):
            return outcome
        if isinstance(outcome, Interrupted):
            raise RecoveryNeeded()
        if isinstance(outcome, NotFormed):
            c.events.add(EventKind.EPOCH_FAILED, f"epoch {c.epoch} did not form: {outcome.detail}")
            for r in outcome.missing:
                self.fault(self.detector.not_joined(r, c.epoch))
            if not self.detector.faults:
                self.detector.error(outcome.detail)
            raise RecoveryNeeded()
        if isinstance(outcome, VerifyFailed):
            self.detector.error(f"{len(outcome.bad)} slots failed verification after the transfer; refilling them")
            c.events.add(EventKind.VERIFY_FAILED, f"slots (rank, layer, slot) {sorted(outcome.bad)[:5]} hold the "
                         "wrong weights")
            raise RecoveryNeeded()
        assert isinstance(outcome, Formed)
        report = outcome.report
        live = list(c.members)
        self.scheduler.set_ranks(holding_of(request, live))
        self.standby.admitted(live)
        self.metrics.epoch.set(c.epoch)
        self.metrics.live_ranks.set(len(live))
        # adopted ranks keep the last leader's epoch warm: their group, slots and shapes are the same
        warm = self.cfg.warmup_gate and not isinstance(request, Adopt)
        if first and warm:
            c.set_readiness(False, "warming up: every batch shape of the step loop, every expert slot")
        elif not warm:
            c.set_readiness(True)
            self.ready_clock.ready()
        c.events.add(EventKind.EPOCH, f"epoch {c.epoch} ({reason}) with ranks {live}", reason=reason,
                     **report.fields())
        if self.traces is not None:
            self.traces.epoch_changed(c.epoch, reason, live, started_s, report.fields())
        if first:
            self.nodes.start_backup()
        # readiness at once; after a fault the /cluster snapshot waits for its usual turn (the
        # pause lasts until the first step, and a snapshot of a new placement is its biggest)
        self.publish(throttle_s=0.25 if isinstance(request, Recover) else 0.0)
        if warm and not first:  # its slots hold other experts: warmed before its first step
            self._warm_up(first=False)
        elif self.cfg.warmup_gate:
            self.warmup.adopted(c.epoch)
        return report

    def _start(self) -> None:
        """The first epoch, over every rank that registered (read once, copy many: after the
        backup of its placement is read)."""
        live = sorted(self.cluster.ranks)
        target = self._read_once(live) if self.cfg.read_once and self.cfg.expert_backup else None
        self.ready_clock.mark("backup_read_s")
        outcome = self.form(Start(live, target), "start")
        self.ready_clock.mark("first_epoch_s")
        if isinstance(outcome, NoPlacement):
            self.recovery.degrade(sorted(self.cluster.ranks), outcome.reason)
        elif self.cfg.warmup_gate:
            self._warm_up(first=True)

    def _adopt(self, adoption: Adoption) -> None:
        """The epoch that adopts the ranks of the last leader (membership/adoption.py)."""
        live, whole, after = adoption.request()
        if not live:  # none came back: the ranks their agents start now form a first epoch
            self.nodes.wait_for_ranks(self._stopping)
            if not self._stopping.is_set():
                self._start()
            return
        outcome = self.form(Adopt(live, whole, adoption.plan.placement, after), "adopt")
        if isinstance(outcome, NoPlacement):
            self.recovery.degrade(live, outcome.reason)
            return
        # before any request is placed (requests reach the scheduler only through `pump`)
        self.scheduler.take_over_kv(adoption.held_kv(self.cluster.members), adoption.journaled, KV_HOLD_S)
        # the last leader's standbys and a scale-up's joiners stand by here; its scale in flight goes on
        self.scaling.take_target(adoption.plan.scale)
        self.standby.park()
        self.scaling.resume(adoption.plan.scale, adoption.plan.rollout)

    def _warm_up(self, first: bool) -> None:
        """The readiness gate (serving/warmup.py): the epoch serves, and /ready opens, once every
        member ran each slot it filled and the group ran every shape one of its members had not,
        with a token on each slot (on the first start: every shape, every slot). A warm-up that
        fails is recovered from as a failed epoch is (the recovery's epoch is warmed up in its turn)."""
        c = self.cluster
        report = self.warmup.run(self.changer.replies, self.changer.filled)  # type: ignore[arg-type]
        if first:
            self.ready_clock.mark("warmup_s")
        split = f" in micro-batches {report.micro_batches}" if any(m > 1 for m in report.micro_batches) else ""
        done = ("every slot computed" if report.shapes else "nothing else to warm") if report.complete \
            else report.problem
        c.events.add(EventKind.WARMUP, f"warm-up of epoch {c.epoch}: {report.filled_slots_warmed} slots run on their "
                     f"ranks as filled ({report.slots_filled} filled), shapes {report.shapes}{split} over ranks "
                     f"{c.members}: {done}", epoch=c.epoch, **report.view())
        if not report.complete:
            if not self.detector.faults:
                self.detector.error(f"the warm-up did not complete: {report.problem}")
            raise RecoveryNeeded()
        c.set_readiness(True)
        self.ready_clock.ready()
        # /ready at once; after a fault the /cluster snapshot waits for its turn, after the first
        # step (the pause lasts until then, and a snapshot of 1,024 ranks is a large build)
        self.publish(throttle_s=0.25 if self.recovery.open else 0.0)

    def _read_once(self, live: list[int]) -> ExpertLocation | None:
        """Read once, copy many: the first epoch's placement, then every node's share of the
        backup for it, read from storage by the node's agent alone, before the epoch forms: its
        ranks then fill their slots from host memory (their node's file, or another node's agent)
        instead of each reading the checkpoint. Waits until every share is written, a fault, or
        --startup-timeout-s (what is missing then comes from disk). None: no placement here."""
        try:
            target = self.changer.balanced(live, self.load())
        except PlacementError:
            return None  # the epoch says why
        self.nodes.start_backup(target)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while self.cluster.backup_progress and not self.detector.pending and time.monotonic() < deadline:
            self.pump(0.02)
        return target

    def _rejoin(self, live: list[int]) -> None:
        """Admit registered ranks at a step boundary; the epoch ends a degraded wait when there was one."""
        self.rebalancer.request("rejoin")  # first: no snapshot may show the new epoch settled
        outcome = self.form(Rejoin(live), "rejoin")
        if isinstance(outcome, NoPlacement):
            self.recovery.degrade(live, outcome.reason)
        else:
            self.recovery.note_epoch(outcome)

    def _sleep_blocker(self) -> str:
        """Why the group cannot fall asleep now ("" when it can)."""
        c = self.cluster
        if not c.readiness.ready:
            return f"not ready ({c.readiness.reason})"
        if self.scheduler.has_work or self.steps.in_step:
            return "requests run or wait; let them finish (or abort them) and retry"
        if self.scaling.active:
            return "a scale or drain is in flight"
        return self.rollout.busy()

    def _check_model(self, path: str) -> str:
        """Why the checkpoint at `path` cannot replace the one served ("" when it holds the same model)."""
        try:
            return self.reader.difference(CheckpointReader(path, MoEConfig.from_pretrained(path), dtype=self.cfg.dtype))
        except Exception as e:  # an operator's directory: whatever fails to read it (a torn file too) is a 400
            return f"model {path!r} cannot be read: {type(e).__name__}: {e}"

    def _forget_measures(self, rank_id: int) -> None:
        """A rank left the cluster: its series and timings go (a new process given its id starts clean)."""
        self.metrics.forget_rank(rank_id)
        self.steps.own_time.forget(rank_id)

    def _views(self, now: float) -> dict[str, Any]:
        """The roles' top-level fields of /cluster."""
        return {"scale": self.scaling.status(), "rollout": self.rollout.status(), "redundancy": self.redundancy.view(),
                "straggler_policy": self.stragglers.view(now), "hardware": self.hardware.view(),
                "standby": {"wanted": self.cfg.standby_ranks, "ready": self.standby.ready()},
                "sleep": self.sleep.view(),
                "cold_start": {**self.ready_clock.view(), "read_once": self.cfg.read_once and self.cfg.expert_backup,
                               "warmup": self.warmup.view(),
                               "read_rate_mb_s": self.cfg.load_read_rate_mb_s, "bytes": self.cluster.loads.by_node()},
                "rebalance": self.rebalancer.status(),
                "listening": {"step": self.plane.step_addr, "health": self.plane.health_addr,
                              "plan": self.plane.plan_addr, "store": f"tcp://{self.cfg.control_host}:{self.store_port}"}}

    def load(self) -> np.ndarray:
        return self.steps.load_window.estimate()

    def joiners(self, live: list[int] | None = None) -> list[int]:
        """Ranks from outside that recovery or a rejoin admits into an epoch over `live` (default
        the members): registered ranks and standbys up to the target size
        (membership/standbys.py); not the joiners of a scale in flight, which join together."""
        return self.standby.joiners(self.cluster.members if live is None else live)

    # ---- the loop ----------------------------------------------------------------------------

    def _iterate(self) -> None:
        """One decision at a step boundary."""
        c = self.cluster
        # a step boundary builds no snapshot: the ranks wait for it; the pumps of a step's wait build it,
        # while the ranks compute (and the pumps of an idle loop)
        self.pump(0.0, snapshot=False)
        if self.detector.pending:
            return
        if self.sleep.blocks_steps:  # asleep or on the way: nothing runs, nothing moves
            self.pump(0.05)
            return
        if self.scaling.active and self.scaling.advance():
            return
        if self.rollout.active and not self.scaling.active:
            self.rollout.advance()
        joiners = self.joiners() if self._joinable else []  # the last housekeeping found some
        if joiners and c.can_serve(c.members + joiners):
            self._rejoin(sorted(c.members + joiners))
            return
        if not c.readiness.ready:
            self._housekeep()
            self.recovery.end_requests_if_degraded_too_long()
            self.pump(0.05)
            return
        if self.changer.suspect_slots:
            bad = sorted(self.changer.suspect_slots)
            self.form(Refill(bad), f"refill slots (rank, layer, slot) {bad[:5]}")
            return
        if not self.scaling.active and self.stragglers.review(time.monotonic()):
            return
        self.rebalancer.check_eplb()
        if self.rebalancer.due():
            self.rebalancer.advance()
            return
        if not self.scheduler.has_work:
            self._housekeep()
            self.pump(0.05)
            return
        wall_s = self.steps.run()  # its wait does the housekeeping
        while True:
            if wall_s is not None:
                self.recovery.step_completed(wall_s)
            if self.steps.ahead is None:
                break
            wall_s = self.steps.run()  # a step sent ahead (--send-ahead-steps) is run before the next boundary

    def _housekeep(self) -> None:
        """What every step boundary looked at though the next step does not wait on it: the last
        step's observation (StepLoop.observe: timings, intervals, metrics), registered
        ranks outside the group parked as standbys (and whether any could join: `_joinable`, which
        the boundary acts on), the standby upkeep, the background slot sweep, the straggler
        verdict when due (StragglerControl.judge). Each walks every rank (the verdict every rank's
        intervals: milliseconds at 256 ranks, every 0.5 s), so it runs once per step in the step's
        wait, after its plans went out (StepLoop's `during_step`), and at a boundary only where no
        step runs (idle, not ready): not after an epoch change either, whose first step (a
        recovery's recompute) is in the pause. What it finds is acted on at the next boundary: a
        rank that registers after it joins a step later."""
        c = self.cluster
        self.steps.observe()  # at a boundary: the last commit's, which no step's send took
        self.standby.park()
        joiners = self.joiners()
        self._joinable = bool(joiners) and c.can_serve(c.members + joiners)
        if not self._joinable and not self.scaling.active:  # a rejoin comes first: its ranks are no shortfall
            self.standby.upkeep()
        if c.readiness.ready and not self.changer.suspect_slots:
            self.sweeper.sweep()
        self.stragglers.judge(time.monotonic())

    # ---- snapshot ----------------------------------------------------------------------------

    def publish(self, throttle_s: float = 0.0, snapshot: bool = True) -> None:
        """Readiness and health at once; the /cluster snapshot at most every `throttle_s`
        (facade/publisher.py), and none that may wait while a recovery's group is ready with
        requests to run: the pause after a fault lasts until its first step, and a snapshot
        (every rank's view, a new placement's) was most of a 256-rank recovery's control
        thread. For at most SNAPSHOT_HOLD_S after the fault, so that one whose step never
        comes still shows. `snapshot` False: readiness and health only (a step boundary)."""
        self.published.sleep_level = self.sleep.level or (self.sleep.moving.level if self.sleep.moving else 0)
        record = self.recovery.record
        if (throttle_s and record is not None and self.cluster.readiness.ready and self.scheduler.has_work
                and time.monotonic() - record.detected_at < SNAPSHOT_HOLD_S):
            throttle_s = math.inf
        self.publisher.publish(throttle_s if snapshot else math.inf)
