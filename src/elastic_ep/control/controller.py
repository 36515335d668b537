"""The controller: membership (epochs), the step loop, health, recovery, and the `Engine`
the HTTP app talks to.

One control thread owns every socket and all cluster state; it alternates between running a
step (send a `StepPlan` to every member, gather `StepResult`s) and handling what arrives:
heartbeats, agent reports, new requests. Everything else (HTTP handlers) talks to it through
a command queue and reads a published snapshot, so no lock guards cluster state.

A fault (a worker exit reported by its agent, a collective that raised, a rank whose
heartbeats stopped, a rank the progress watchdog names) stops the step loop. Recovery then:
fences the culprits (their agent kills them and confirms), waits for every other member to
leave the failed step, computes a placement over the live ranks, sends the new epoch with a
transfer plan, checks every slot's checksum and re-runs the step; the dead ranks' requests are
re-prefilled on the others. Requests never see an error, only a pause.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import signal
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import psutil
import torch.distributed as dist
import zmq
from prometheus_client import CollectorRegistry

from elastic_ep.errors import ElasticEPError, PlacementError
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.config import MoEConfig
from elastic_ep.placement.fault_aware import fault_aware_placement
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.placement.measures import balancedness
from elastic_ep.placement.transfer import plan_transfers

from .api import EngineInfo, GenerationRequest, Readiness, RequestOutput, ScaleRejected, ServiceUnavailable
from .backup import backup_shares
from .config import ServeConfig
from .epoch_plan import held_placement, split_by_rank, trimmed
from .health import adaptive_deadline_s, hung_ranks, lost_heartbeats, relative_speeds
from .membership import AgentState, RankState
from .messages import (
    AgentBye,
    AgentHello,
    AgentShutdown,
    AgentWelcome,
    BackupAssign,
    BackupReady,
    BackupSite,
    EpochFailed,
    EpochReady,
    EpochStart,
    FenceWorker,
    Heartbeat,
    Progress,
    Shutdown,
    SignalWorker,
    StartWorker,
    StepFailed,
    StepPlan,
    StepResult,
    WorkerExited,
    WorkerFenced,
    WorkerHello,
    WorkerStarted,
    decode,
    encode,
)
from .metrics import ClusterMetrics
from .recorder import ExpertRecorder
from .scaling import (
    ScaleOp,
    agent_for_new_rank,
    check_target,
    new_rank_ids,
    ranks_to_retire,
    scale_limits,
    status_view,
)
from .scheduler import Scheduler, Sequence, StepBatch


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RecoveryNeeded(Exception):
    """Raised inside the control loop when a fault interrupts a step or an epoch change."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Controller:
    """Implements `control.api.Engine`. Start with `start()`, stop with `stop()`."""

    MAX_FAILURES_WITHOUT_CULPRIT = 3

    def __init__(self, cfg: ServeConfig, registry: CollectorRegistry | None = None):
        self.cfg = cfg
        self.config = MoEConfig.from_pretrained(cfg.model_dir)
        self.reader = CheckpointReader(cfg.model_dir, self.config)
        num_experts = self.config.num_experts
        total_slots = num_experts + cfg.redundant_experts
        if cfg.ep_size < 1 or total_slots % cfg.ep_size:
            raise ElasticEPError(
                f"{num_experts} experts + {cfg.redundant_experts} redundant = {total_slots} slots do not split "
                f"evenly over --ep-size {cfg.ep_size}; choose --redundant-experts so the sum is a multiple of it"
            )
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "eplb_interval"):
            if getattr(cfg, name) < 1:
                raise ElasticEPError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
        if cfg.max_model_len > self.config.max_position_embeddings:
            raise ElasticEPError(
                f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.config.max_position_embeddings}; lower it"
            )
        self.slots_per_rank = total_slots // cfg.ep_size
        if cfg.max_ranks < cfg.ep_size:
            raise ElasticEPError(f"--max-ep-size {cfg.max_ep_size} is below --ep-size {cfg.ep_size}; raise it")
        self.num_moe_layers = len(self.config.moe_layers)
        self.info = EngineInfo(cfg.model_name, cfg.max_model_len, tuple(self.config.eos_token_ids))
        self.metrics = ClusterMetrics(registry or CollectorRegistry())
        self.scheduler = Scheduler(cfg.max_num_seqs, cfg.max_num_batched_tokens)

        self.ranks: dict[int, RankState] = {}
        self.agents: dict[str, AgentState] = {}
        self.epoch = -1
        self.members: list[int] = []
        self.location: ExpertLocation | None = None
        self.reference_checksums: dict[tuple[int, int], int] = {}
        self.suspect_slots: set[tuple[int, int, int]] = set()
        self.faults: dict[int, str] = {}
        self.fault_detected_at: float | None = None
        self.fencing: dict[int, float] = {}
        self.restart_at: dict[int, float] = {}
        self.delay_s: dict[int, float] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=200)
        self.step = 0
        self.recent_step_s: deque[float] = deque(maxlen=32)
        self.seq_first_seen: dict[int, float] = {}
        self.load_window: deque[np.ndarray] = deque(maxlen=max(cfg.eplb_interval, 1))
        self.recorder = ExpertRecorder(self.num_moe_layers, self.config.num_experts, self.config.moe_layers)
        self.streams: dict[int, _Stream] = {}
        self.pending_recovery_record: dict[str, Any] | None = None
        self.scale_op: ScaleOp | None = None
        self.target_ep_size = cfg.ep_size  # what the last finished scale asked for: new agents fill up to it
        self._scale_lock = threading.Lock()
        self._ready = Readiness(False, "starting: waiting for ranks to register")
        self._snapshot: dict[str, Any] = {}
        self._ids = itertools.count()
        self._commands: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.fatal: str | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.degraded_since: float | None = None
        self.trouble: list[str] = []
        self.failed_epochs = 0
        self.inflight: set[int] = set()
        self._failed_batch: StepBatch | None = None
        self._step_replies: dict[int, StepResult | StepFailed] = {}
        self._epoch_replies: dict[int, EpochReady | EpochFailed] = {}
        self._last_eplb_step = -1
        self._published_at = 0.0
        self._health_checked_at = 0.0

        self.ctx = zmq.Context.instance()
        self.store_port = _free_port(cfg.host)
        self.store = dist.TCPStore(
            cfg.host, self.store_port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.step_sock = self.ctx.socket(zmq.ROUTER)
        self.health_sock = self.ctx.socket(zmq.ROUTER)
        for s in (self.step_sock, self.health_sock):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.step_addr = f"tcp://{cfg.host}:{self.step_sock.bind_to_random_port(f'tcp://{cfg.host}')}"
        self.health_addr = f"tcp://{cfg.host}:{self.health_sock.bind_to_random_port(f'tcp://{cfg.host}')}"
        self.poller = zmq.Poller()
        self.poller.register(self.step_sock, zmq.POLLIN)
        self.poller.register(self.health_sock, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._publish()

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="control-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut down workers (via agents) and the control loop."""
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _command(self, *cmd) -> None:
        self._commands.put(cmd)
        self._wake()

    def _event(self, kind: str, message: str, rank_id: int | None = None, **extra) -> None:
        self.events.append({"time_s": time.time(), "kind": kind, "rank_id": rank_id, "message": message, **extra})

    def _run(self) -> None:
        try:
            try:
                self._wait_for_initial_ranks()
            except RecoveryNeeded:
                pass
            while not self._stopping.is_set():
                try:
                    if self.faults or self.trouble:
                        self._recover()
                    else:
                        self._iterate()
                except RecoveryNeeded:
                    continue
        except Exception as e:  # the loop must not die silently: readiness says why
            self.fatal = f"{type(e).__name__}: {e}"
            self._ready = Readiness(False, f"control loop failed: {self.fatal}")
            self._event("fatal", self.fatal)
            self._publish()
            if self.on_fatal is not None:
                self.on_fatal()
            raise
        finally:
            self._shutdown_cluster()

    def _shutdown_cluster(self) -> None:
        for r in self.ranks.values():
            if r.state not in ("dead", "fenced"):
                self._send_step(r.rank_id, Shutdown())
        for agent in self.agents.values():
            self._send_health(agent.identity, AgentShutdown())
        for seq_id, stream in list(self.streams.items()):
            self._deliver(seq_id, RequestOutput(stream.request_id, [], True, "error", "server shutting down"))
        time.sleep(0.1)

    # ---- sockets -----------------------------------------------------------------------

    def _send_step(self, rank_id: int, message) -> None:
        self.step_sock.send_multipart([f"w{rank_id}".encode(), encode(message)])

    def _send_health(self, identity: bytes, message) -> None:
        self.health_sock.send_multipart([identity, encode(message)])

    def _send_agent(self, node: str, message) -> None:
        agent = self.agents.get(node)
        if agent is not None:
            self._send_health(agent.identity, message)

    def _pump(self, timeout_s: float) -> None:
        """Wait up to timeout_s for input, handle everything that arrived, run health checks."""
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while self.health_sock.poll(0):
            identity, frame = self.health_sock.recv_multipart()
            self._on_health(identity, decode(frame))
        while self.step_sock.poll(0):
            _, frame = self.step_sock.recv_multipart()
            self._on_step(decode(frame))
        self._drain_commands()
        self._check_health()
        self._publish(throttle_s=0.25)

    # ---- messages ----------------------------------------------------------------------

    def _on_health(self, identity: bytes, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, Heartbeat):
            r = self.ranks.get(msg.rank_id)
            if r is None or r.pid != msg.pid:
                return
            r.last_heartbeat = now
            if msg.progress.epoch == self.epoch and msg.progress.seq not in self.seq_first_seen:
                self.seq_first_seen[msg.progress.seq] = now
            r.progress = msg.progress
        elif isinstance(msg, AgentBye):
            self._drop_backup(msg.node, "its agent stopped")
            self.agents.pop(msg.node, None)
        elif isinstance(msg, AgentHello):
            self.agents[msg.node] = AgentState(msg.node, identity, msg.fetch_addr, msg.num_ranks, msg.auto_recover)
            self._welcome(self.agents[msg.node], msg.join_mode)
        elif isinstance(msg, WorkerStarted):
            r = self.ranks.get(msg.rank_id)
            if r is None or r.state == "retiring":  # it left the cluster (its scale ended) before it started
                self._send_health(identity, FenceWorker(msg.rank_id, msg.pid, "it left the cluster", final=True))
                return
            r.node, r.pid, r.state, r.last_heartbeat = msg.node, msg.pid, "starting", now
            r.progress, r.hello = Progress(), None
            self._event("started", f"rank {msg.rank_id} started on {msg.node} (pid {msg.pid})", msg.rank_id)
        elif isinstance(msg, WorkerExited):
            r = self.ranks.get(msg.rank_id)
            if r is None or r.pid != msg.pid:
                return
            if r.state != "retiring":
                self._fault(msg.rank_id, f"process exited with code {msg.returncode}")
            if r.state == "retiring":  # also when the fault above failed a scale it was joining
                self._forget_rank(msg.rank_id, f"rank {msg.rank_id} stopped (exit code {msg.returncode})")
                return
            r.state = "dead"
            self.fencing.pop(msg.rank_id, None)
        elif isinstance(msg, WorkerFenced):
            r = self.ranks.get(msg.rank_id)
            if r is not None and r.pid == msg.pid and r.state == "retiring":
                self._forget_rank(msg.rank_id, f"rank {msg.rank_id} stopped")
            elif r is not None and r.pid == msg.pid and r.state == "fencing":
                r.state = "fenced"
                self.fencing.pop(msg.rank_id, None)
        elif isinstance(msg, BackupReady):
            agent = self.agents.get(msg.node)
            if agent is not None:
                agent.backup, agent.backup_experts = msg.site, msg.experts
                self._event("backup", f"node {msg.node} holds {len(msg.experts)} experts in host memory "
                            f"({msg.nbytes} bytes)", nbytes=msg.nbytes, path=msg.site.path)

    def _on_step(self, msg) -> None:
        if isinstance(msg, WorkerHello):
            r = self.ranks.setdefault(msg.rank_id, RankState(msg.rank_id, msg.node))
            if r.pid != msg.pid:
                return
            r.hello, r.last_heartbeat = msg, time.monotonic()
            self._event("registered", f"rank {msg.rank_id} registered ({msg.join_mode}); dense weights from "
                        f"{msg.dense_source} in {msg.load_s:.2f}s, warmed up in {msg.warmup_s:.3f}s", msg.rank_id,
                        dense_source=msg.dense_source, load_s=msg.load_s, warmup_s=msg.warmup_s)
        elif isinstance(msg, StepResult | StepFailed):
            if msg.epoch == self.epoch and msg.step == self.step:
                self._step_replies[msg.rank_id] = msg
                if isinstance(msg, StepFailed):
                    self.trouble.append(f"rank {msg.rank_id}: {msg.error}")
                    if self.fault_detected_at is None:
                        self.fault_detected_at = time.monotonic()
        elif isinstance(msg, EpochReady | EpochFailed):
            if msg.epoch == self.epoch:
                self._epoch_replies[msg.rank_id] = msg
            if isinstance(msg, EpochFailed) and msg.unreachable_node:
                self._drop_backup(msg.unreachable_node, "its agent does not answer")

    def _fault(self, rank_id: int, cause: str) -> None:
        if rank_id in self.faults:
            return
        r = self.ranks[rank_id]
        if r.state in ("dead", "fenced", "retiring"):
            return
        op = self.scale_op
        if op is not None and op.active and rank_id in op.new_ranks and rank_id not in self.members:
            self._fail_scale(f"joining rank {rank_id} failed: {cause}")
            return
        self.faults[rank_id] = cause
        if self.fault_detected_at is None:
            self.fault_detected_at = time.monotonic()
        self._event("fault", f"rank {rank_id}: {cause}", rank_id, cause=cause)

    def _check_health(self) -> None:
        now = time.monotonic()
        if not self.cfg.health_checks or now - self._health_checked_at < self.cfg.health_check_period_s:
            return
        self._health_checked_at = now
        watched = {r.rank_id: r.last_heartbeat for r in self.ranks.values()
                   if r.state in ("serving", "draining") or (r.state == "starting" and r.hello is not None)}
        for rank_id in lost_heartbeats(watched, now, self.cfg.heartbeat_timeout_s):
            self._fault(rank_id, f"no heartbeat for {self.cfg.heartbeat_timeout_s:.2f}s (stopped or cut off)")
        if self.inflight:
            deadline = self.watchdog_deadline_s()
            progress = {r: self.ranks[r].progress for r in self.members if r not in self.faults}
            for rank_id in hung_ranks(progress, self.epoch, self.seq_first_seen, now, deadline):
                p = progress[rank_id]
                self._fault(rank_id, f"hung: has not entered collective {max(x.seq for x in progress.values())} "
                            f"the others wait in for {deadline:.2f}s (last at layer {p.layer} {p.phase})")
        for rank_id, t in list(self.restart_at.items()):
            if now >= t:
                del self.restart_at[rank_id]
                node = self.ranks[rank_id].node
                self._send_agent(node, StartWorker(rank_id, "recover", self._dense_site(node)))

    def watchdog_deadline_s(self) -> float:
        return adaptive_deadline_s(self.recent_step_s, self.cfg.watchdog_multiple, self.cfg.watchdog_floor_s)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, seq, stream = cmd
                self.streams[seq.seq_id] = stream
                self.scheduler.add(seq)
            elif kind == "abort":
                self.scheduler.abort(cmd[1])
                self.streams.pop(cmd[1], None)
            elif kind == "signal":
                _, rank_id, sig = cmd
                r = self.ranks[rank_id]
                self._send_agent(r.node, SignalWorker(rank_id, r.pid, sig))
                self._event("chaos", f"{signal.Signals(sig).name} to rank {rank_id} (pid {r.pid})", rank_id)
            elif kind == "slow":
                self.delay_s[cmd[1]] = cmd[2]
                self._event("chaos", f"rank {cmd[1]} slowed by {cmd[2]}s per step", cmd[1])

    # ---- startup -----------------------------------------------------------------------

    def _welcome(self, agent: AgentState, join_mode: str = "initial") -> None:
        """Give a new agent its ranks: free rank ids, or with join_mode recover (a replacement
        node) ranks that are down, which it starts again in their place."""
        self._send_health(agent.identity, AgentWelcome(self._worker_args()))
        if join_mode == "recover":
            down = sorted(r.rank_id for r in self.ranks.values() if r.state in ("dead", "fenced"))
            for rank_id in down[: agent.num_ranks]:
                self.restart_at.pop(rank_id, None)
                self.ranks[rank_id].node = agent.node
                self._event("replace", f"rank {rank_id} moves to node {agent.node}", rank_id)
                self._send_health(agent.identity, StartWorker(rank_id, "recover", self._dense_site(agent.node)))
            return
        taken = set(self.ranks)
        free = [r for r in range(self.target_ep_size) if r not in taken]
        for rank_id in free[: agent.num_ranks]:
            self.ranks[rank_id] = RankState(rank_id, agent.node)
            self._send_health(agent.identity, StartWorker(rank_id, "initial"))

    def _drop_backup(self, node: str, why: str) -> None:
        """Stop planning transfers from a node's backup (and dense weights from it)."""
        agent = self.agents.get(node)
        if agent is not None and agent.backup is not None:
            agent.backup, agent.backup_experts = None, []
            self._event("backup-lost", f"node {node}'s backup is gone: {why}", node=node)

    def _dense_site(self, node: str) -> BackupSite | None:
        """An agent with the dense weights in host memory: the rank's own node first."""
        sites = [a.backup for a in self.agents.values() if a.backup is not None]
        return next((s for s in sites if s.node == node), sites[0] if sites else None)

    def _wait_for_initial_ranks(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not self._stopping.is_set():
            hello = [r for r in self.ranks.values() if r.hello is not None]
            self._ready = Readiness(False, f"starting: {len(hello)}/{self.cfg.ep_size} ranks registered")
            self._publish()
            if len(hello) >= self.cfg.ep_size:
                break
            dead = [r for r in self.ranks.values() if r.state == "dead"]
            if dead:
                raise ElasticEPError(f"rank {dead[0].rank_id} exited during startup; see its log above")
            if time.monotonic() > deadline:
                raise ElasticEPError(
                    f"only {len(hello)} of {self.cfg.ep_size} ranks registered within --startup-timeout-s "
                    f"{self.cfg.startup_timeout_s}; check the worker logs"
                )
            self._pump(0.05)
        self.faults.clear()
        self.fault_detected_at = None
        self._change_epoch(sorted(self.ranks), "start", np.ones((self.num_moe_layers, self.config.num_experts)))

    def _start_backup(self) -> None:
        """Give every agent its share of the expert backup, if memory allows."""
        if not self.cfg.expert_backup:
            self._event("backup", "expert backup disabled (--no-expert-backup)")
            return
        total = self.reader.expert_nbytes * self.num_moe_layers * self.config.num_experts
        room = psutil.virtual_memory().available
        if total > room // 2:
            self._event("backup", f"expert backup off: {total} bytes exceed half the free memory ({room})")
            return
        assert self.location is not None
        for node, items in backup_shares(self.location, self._rank_nodes(), sorted(self.agents)).items():
            self._send_health(self.agents[node].identity, BackupAssign(items))

    def _worker_args(self) -> dict[str, Any]:
        return {
            "model_dir": self.cfg.model_dir,
            "step_addr": self.step_addr,
            "health_addr": self.health_addr,
            "store_host": self.cfg.host,
            "store_port": self.store_port,
            "backend": self.cfg.backend,
            "max_num_seqs": self.cfg.max_num_seqs,
            "max_model_len": self.cfg.max_model_len,
            "heartbeat_interval_s": self.cfg.heartbeat_interval_s if self.cfg.health_checks else 0.0,
            "dense_fetch_timeout_s": self.cfg.backup_fetch_timeout_s,
        }

    # ---- the step loop -----------------------------------------------------------------

    def _iterate(self) -> None:
        self._pump(0.0)
        if self.faults or self.trouble:
            return
        if self.scale_op is not None and self.scale_op.active and self._advance_scale():
            return
        joiners = self._joiners()
        if joiners and self._can_serve(sorted(self.members + joiners)):
            self._change_epoch(sorted(self.members + joiners), "rejoin", self._load_estimate())
            return
        if not self._ready.ready:
            self._end_requests_if_degraded_too_long()
            self._pump(0.05)
            return
        if self._eplb_due():
            self._rebalance()
            return
        if not self.scheduler.has_work:
            self._pump(0.05)
            return
        self._run_step()

    def _joiners(self) -> list[int]:
        return sorted(
            r.rank_id for r in self.ranks.values()
            if r.hello is not None and r.state == "starting" and r.rank_id not in self.members
            and r.rank_id not in self.faults and not self._scale_joiner(r.rank_id)
        )

    def _can_serve(self, ranks: list[int]) -> bool:
        return len(ranks) * self.slots_per_rank >= self.config.num_experts

    def _run_step(self) -> None:
        batch = self.scheduler.schedule()
        self.step += 1
        self._step_replies = {}
        self.inflight = set(self.members)
        start = time.perf_counter()
        busiest = max(batch.tokens_per_rank().values(), default=0)
        dispatch_rows = busiest * self.config.top_k if busiest <= self.cfg.padded_dispatch_max_tokens else 0
        for rank_id in self.members:
            self._send_step(rank_id, StepPlan(
                self.epoch, self.step, batch.chunks.get(rank_id, []), batch.free.get(rank_id, []),
                self.delay_s.get(rank_id, 0.0), dispatch_rows,
            ))
        while len(self._step_replies) < len(self.members):
            self._pump(0.002)
            if self.faults or self.trouble:
                self._requeue_frees(batch)
                self._failed_batch = batch
                raise RecoveryNeeded()
        self.inflight = set()
        wall_s = time.perf_counter() - start
        self._finish_step(batch, wall_s)

    def _requeue_frees(self, batch: StepBatch) -> None:
        """A failed step's frees may not have run: ask again in the next step."""
        for rank_id, ids in batch.free.items():
            if rank_id in self.scheduler.to_free:
                self.scheduler.to_free[rank_id].extend(ids)

    def _finish_step(self, batch: StepBatch, wall_s: float) -> None:
        results: dict[int, StepResult] = self._step_replies  # type: ignore[assignment]
        sampled: dict[int, int] = {}
        slowest = 0.0
        load = np.zeros((self.num_moe_layers, self.config.num_experts), dtype=np.int64)
        for rank_id, res in results.items():
            sampled.update(res.tokens)
            slowest = max(slowest, res.step_s)
            r = self.ranks[rank_id]
            r.step_s.append(res.step_s)
            r.wait_s.append(res.dispatch_wait_s + res.combine_wait_s)
            r.own_s.append(res.compute_s)
            r.slot_tokens.append(res.slot_tokens)
            label = str(rank_id)
            self.metrics.step_seconds.labels(label).observe(res.step_s)
            self.metrics.collective_wait_seconds.labels(label).observe(res.dispatch_wait_s + res.combine_wait_s)
            load += res.expert_load
        self.recent_step_s.append(wall_s)
        self.metrics.step_wall_seconds.observe(wall_s)
        self.failed_epochs = 0
        self._failed_batch = None
        self.metrics.controller_overhead_seconds.observe(max(wall_s - slowest, 0.0))
        tokens = batch.tokens_per_rank()
        for rank_id, n in tokens.items():
            self.metrics.rank_tokens.labels(str(rank_id)).set(n)
        if sum(tokens.values()):
            self.metrics.dp_token_imbalance.set(max(tokens.values()) / (sum(tokens.values()) / len(tokens)))
        slot_totals = {r: sum(self.ranks[r].slot_tokens) for r in self.members}
        mean = sum(slot_totals.values()) / max(len(slot_totals), 1)
        if mean:
            for r, v in slot_totals.items():
                self.metrics.expert_load_imbalance.labels(str(r)).set(v / mean)
        self.load_window.append(load)
        self.recorder.add(load)
        for seq, new_tokens in self.scheduler.commit(batch, sampled):
            self._deliver(seq.seq_id, RequestOutput(
                seq.request.request_id, new_tokens, seq.finish_reason is not None, seq.finish_reason,
            ))
        if self.pending_recovery_record is not None:
            record = self.pending_recovery_record
            record["recompute_s"] = round(wall_s, 4)
            record["total_s"] = round(time.monotonic() - record.pop("_detected_at"), 4)
            self.metrics.recovery_seconds.observe(record["total_s"])
            self._event("recovered", f"epoch {self.epoch} serving again after {record['total_s']:.3f}s", **record)
            self.pending_recovery_record = None

    def _fail_batch(self, batch: StepBatch, error: str) -> None:
        """End the requests of a step that keeps failing with no rank to blame (a deterministic
        error, not a fault): they finish with an error, the server goes on serving."""
        for chunks in batch.chunks.values():
            for c in chunks:
                self._end_with_error(c.seq_id, error)
        self._event("request-error", f"failed the requests of a step that failed {self.failed_epochs} times: {error}")
        self.failed_epochs = 0
        self._failed_batch = None

    def _end_with_error(self, seq_id: int, error: str) -> None:
        seq = self.scheduler.by_id.get(seq_id)
        if seq is not None:
            self.scheduler.abort(seq_id)
            self._deliver(seq_id, RequestOutput(seq.request.request_id, [], True, "error", error))

    def _deliver(self, seq_id: int, out: RequestOutput) -> None:
        stream = self.streams.get(seq_id)
        if stream is None:
            return
        if out.finished:
            del self.streams[seq_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:
            self.scheduler.abort(seq_id)

    # ---- membership changes ------------------------------------------------------------

    def _load_estimate(self) -> np.ndarray:
        if self.load_window:
            total = np.sum(np.stack(list(self.load_window)), axis=0).astype(np.float64)
            if total.sum() > 0:
                return total + 1.0
        return np.ones((self.num_moe_layers, self.config.num_experts))

    def _recover(self) -> None:
        detected_at = self.fault_detected_at or time.monotonic()
        t0 = time.monotonic()
        self._fence_and_drain()
        fence_s = time.monotonic() - t0
        culprits = dict(self.faults)
        failures = list(self.trouble)
        live = [r for r in self.members if r not in culprits and self.ranks[r].state not in ("dead", "fenced")]
        for r in culprits:
            self.scheduler.evict_rank(r)
            self.metrics.forget_rank(r)
            self.delay_s.pop(r, None)
            if self._scale_joiner(r):
                self._fail_scale(f"joining rank {r} failed: {culprits[r]}")
            agent = self.agents.get(self.ranks[r].node)
            if self._leaves_with_scale(r):
                self._forget_rank(r, f"rank {r} left with its scale")
            elif self.cfg.restart_delay_s >= 0 and not (agent is not None and agent.auto_recover):
                self.restart_at[r] = time.monotonic() + self.cfg.restart_delay_s
        for r in [r for r in live if self._leaves_with_scale(r) and self.ranks[r].state != "draining"]:
            live.remove(r)
            self._stop_rank(r)
        cause = "; ".join(f"rank {r}: {c}" for r, c in sorted(culprits.items())) or (
            "error without a dead rank: " + "; ".join(failures[:4])
        )
        for kind in {_cause_kind(c) for c in culprits.values()} or {"collective"}:
            self.metrics.recoveries.labels(kind).inc()
        self.faults.clear()
        self.trouble.clear()
        self.fault_detected_at = None
        if not culprits:
            self.failed_epochs += 1
            if self.failed_epochs >= self.MAX_FAILURES_WITHOUT_CULPRIT and self._failed_batch is not None:
                self._fail_batch(self._failed_batch, cause)
        prev = self.pending_recovery_record
        self.pending_recovery_record = {
            "_detected_at": min(prev["_detected_at"], detected_at) if prev else detected_at,
            "culprits": sorted(set(prev["culprits"] if prev else ()) | set(culprits)),
            "cause": f"{prev['cause']}; then {cause}" if prev else cause,
            "detect_to_fence_s": round(fence_s, 4),
        }
        self._event("fencing", f"fenced {sorted(culprits)}: {cause}", sorted(culprits)[0] if culprits else None)
        live = sorted(set(live) | set(self._joiners()))
        holding = [r for r in live if not self._leaves_with_scale(r)]
        if not self._can_serve(holding):
            self._degrade(holding)
            return
        self._change_epoch(live, "recovery", self._load_estimate(), holding=holding)

    def _degrade(self, live: list[int], reason: str = "") -> None:
        need = -(-self.config.num_experts // self.slots_per_rank)
        reason = reason or (f"too few ranks: {len(live)} live ranks x {self.slots_per_rank} slots cannot hold "
                            f"{self.config.num_experts} experts (need {need} ranks); waiting for ranks to return")
        self._ready = Readiness(False, reason)
        self.members = [r for r in self.members if r in live]
        self.degraded_since = self.degraded_since or time.monotonic()
        self._event("degraded", reason)
        self._publish()

    def _end_requests_if_degraded_too_long(self) -> None:
        """Requests already streaming wait while the cluster cannot serve, but not forever:
        after --degraded-timeout-s they end with an error that says why."""
        if self.degraded_since is None or time.monotonic() - self.degraded_since < self.cfg.degraded_timeout_s:
            return
        error = f"not served for {self.cfg.degraded_timeout_s:.0f}s: {self._ready.reason}"
        for seq_id in list(self.scheduler.by_id):
            self._end_with_error(seq_id, error)
        self._event("request-error", f"ended the waiting requests: {error}")
        self.degraded_since = time.monotonic()

    def _fence_and_drain(self) -> None:
        """Fence every culprit and wait until every other member has left the failed step; a
        member that does not answer within drain_timeout_s becomes a culprit too."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        in_step = sorted(self.inflight)
        while True:
            for rank_id in list(self.faults):
                r = self.ranks[rank_id]
                if r.state not in ("dead", "fenced") and rank_id not in self.fencing and r.pid is not None:
                    self.fencing[rank_id] = time.monotonic()
                    self._send_agent(r.node, FenceWorker(rank_id, r.pid, self.faults[rank_id]))
                    r.state = "fencing"
            waiting = [r for r in in_step if r not in self._step_replies and r not in self.faults]
            if not waiting and not self.fencing:
                self.inflight = set()
                return
            if time.monotonic() > deadline:
                for r in waiting:
                    self._fault(r, f"no answer {self.cfg.drain_timeout_s}s after the fault (hung in a collective)")
                for r in list(self.fencing):
                    self._event("fence-timeout", f"agent did not confirm fencing rank {r}", r)
                    self.ranks[r].state = "dead"
                    self.fencing.pop(r)
                deadline = time.monotonic() + self.cfg.fence_timeout_s
            self._pump(0.002)

    def _rank_nodes(self) -> dict[int, str]:
        return {r.rank_id: r.node for r in self.ranks.values()}

    def _backup_map(self) -> dict[tuple[int, int], str]:
        out = {}
        for agent in self.agents.values():
            if agent.backup is not None:
                for item in agent.backup_experts:
                    out[tuple(item)] = agent.node
        return out

    def _change_epoch(self, live: list[int], reason: str, load: np.ndarray,
                      new: ExpertLocation | None = None, holding: list[int] | None = None) -> None:
        """Form a new epoch over `live` with a placement for `load`, move the experts, verify.
        `holding`: the members that hold experts and get requests (default all); the others only
        send what they hold (scale-down). Raises RecoveryNeeded when a fault interrupts it."""
        t0 = time.monotonic()
        rank_nodes = self._rank_nodes()
        holding = list(live) if holding is None else holding
        num_ranks = max(self.cfg.ep_size, max(live) + 1)
        if new is None:
            try:
                new = fault_aware_placement(load, holding, rank_nodes, None, self.slots_per_rank, num_ranks,
                                            current=self.location)
            except PlacementError as e:
                self._degrade(live, f"no placement over ranks {live}: {e}")
                return
        placement_s = time.monotonic() - t0
        s = self.slots_per_rank
        old = held_placement(self.location, self.num_moe_layers, self.config.num_experts, s, num_ranks,
                             [r for r in live if self.ranks[r].state in ("serving", "draining")], self.suspect_slots)
        plan = plan_transfers(old, new, live, rank_nodes, self._backup_map(), self.reader.expert_nbytes)
        sources, sends = split_by_rank(plan, s)
        backups = {a.node: a.backup for a in self.agents.values() if a.backup is not None}
        self.epoch += 1
        self.members = list(live)
        self.seq_first_seen = {}
        self._epoch_replies = {}
        self.store.set(f"epoch/{self.epoch}/members", json.dumps(live))
        for rank_id in live:
            self._send_step(rank_id, EpochStart(
                self.epoch, live, np.asarray(new.phy2log), s, sources[rank_id], sends[rank_id], backups,
                self.cfg.collective_timeout_s, self.cfg.backup_fetch_timeout_s,
            ))
        deadline = time.monotonic() + self.cfg.epoch_timeout_s
        while len(self._epoch_replies) < len(live):
            self._pump(0.002)
            if any(r in self.faults for r in live):
                raise RecoveryNeeded()
            failed = [m for m in self._epoch_replies.values() if isinstance(m, EpochFailed)]
            if failed or time.monotonic() > deadline:
                missing = [r for r in live if r not in self._epoch_replies]
                detail = "; ".join(f"rank {m.rank_id}: {m.error}" for m in failed) or f"ranks {missing} timed out"
                self._event("epoch-failed", f"epoch {self.epoch} did not form: {detail}")
                for r in missing if not failed else []:
                    self._fault(r, f"did not join epoch {self.epoch} within {self.cfg.epoch_timeout_s}s")
                if not self.faults:
                    self.trouble.append(detail)
                raise RecoveryNeeded()
        replies: dict[int, EpochReady] = self._epoch_replies  # type: ignore[assignment]
        bad = self._verify(new, replies)
        if bad:
            self.suspect_slots |= bad
            self.trouble.append(f"{len(bad)} slots failed verification after the transfer; refilling them")
            self._event("verify-failed", f"slots (rank, layer, slot) {sorted(bad)[:5]} hold the wrong weights")
            raise RecoveryNeeded()
        first = self.location is None
        self.location = new
        self.suspect_slots.clear()
        for r in live:
            self.ranks[r].state = "serving" if r in holding else "draining"
        self.scheduler.set_ranks(holding)
        self.metrics.epoch.set(self.epoch)
        self.metrics.live_ranks.set(len(live))
        by_source: dict[str, dict[str, float]] = defaultdict(lambda: {"bytes": 0, "seconds": 0.0})
        for rep in replies.values():
            for st in rep.transfers:
                by_source[st.source]["bytes"] += st.bytes_moved
                by_source[st.source]["seconds"] = max(by_source[st.source]["seconds"], round(st.seconds, 4))
        details = {
            "epoch": self.epoch, "members": live, "placement_s": round(placement_s, 4),
            "rendezvous_s": round(max(r.rendezvous_s for r in replies.values()), 4),
            "transfer_s": round(max(r.transfer_s for r in replies.values()), 4),
            "verify_s": round(max(r.verify_s for r in replies.values()), 4),
            "transfers": dict(by_source), "epoch_change_s": round(time.monotonic() - t0, 4),
        }
        self._ready = Readiness(True)
        self.degraded_since = None
        self._event("epoch", f"epoch {self.epoch} ({reason}) with ranks {live}", reason=reason, **details)
        if self.pending_recovery_record is not None:
            self.pending_recovery_record.update(details)
        if first:
            self._start_backup()
        self._publish()

    def _verify(self, location: ExpertLocation, replies: dict[int, EpochReady]) -> set[tuple[int, int, int]]:
        """(rank, layer, slot) of every occupied slot that does not hold its expert's weights
        (checksum recorded when the expert was first read from disk) or reports nothing."""
        bad = set()
        for rank_id, rep in replies.items():
            for (li, j), expert in np.ndenumerate(location.experts_of_rank(rank_id)):
                if expert < 0:
                    continue
                checksum = rep.checksums.get((li, j))
                if checksum is None or self.reference_checksums.setdefault((li, int(expert)), checksum) != checksum:
                    bad.add((rank_id, li, j))
        return bad

    def _eplb_due(self) -> bool:
        return (self.cfg.enable_eplb and self.step > 0 and self.step % self.cfg.eplb_interval == 0
                and len(self.load_window) >= self.cfg.eplb_interval and self._last_eplb_step != self.step)

    def _rebalance(self) -> None:
        self._last_eplb_step = self.step
        load = self._load_estimate()
        assert self.location is not None
        # imbalance is judged in time (load / speed) when speeds are on: a slow rank with an even
        # share of tokens is the imbalance to fix, and a plan that unloads it must not look worse
        speeds = relative_speeds({r: self.ranks[r].own_s for r in self.members}) if self.cfg.eplb_speed_aware else None
        before = float(1 / balancedness(self.location, load, self.members, speeds).min())
        if before < self.cfg.eplb_threshold:
            return
        new = fault_aware_placement(load, self.members, self._rank_nodes(), speeds, self.slots_per_rank,
                                    self.location.num_ranks, current=self.location, movement_tolerance=0.0)
        after = float(1 / balancedness(new, load, self.members, speeds).min())
        if new == self.location or after >= before:
            return
        self.metrics.eplb_rebalances.inc()
        self._change_epoch(self.members, f"eplb: imbalance {before:.2f} -> {after:.2f}", load, new=new)

    # ---- scaling -----------------------------------------------------------------------

    def _scale_joiner(self, rank_id: int) -> bool:
        op = self.scale_op
        return op is not None and op.active and rank_id in op.new_ranks

    def _leaves_with_scale(self, rank_id: int) -> bool:
        """Chosen to leave by a scale-down, or started by a scale-up that failed."""
        op = self.scale_op
        return op is not None and (rank_id in op.retiring or (op.phase == "failed" and rank_id in op.new_ranks))

    def _intended_ranks(self) -> list[int]:
        """Ranks meant to serve: members plus ranks starting or waiting to be restarted."""
        return sorted(r.rank_id for r in self.ranks.values() if r.state != "retiring")

    def _stop_rank(self, rank_id: int) -> None:
        """Stop a rank that leaves the cluster; its exit report removes it from /cluster."""
        r = self.ranks[rank_id]
        r.state = "retiring"
        self.scheduler.draining.discard(rank_id)
        if r.hello is not None:
            self._send_step(rank_id, Shutdown())
        elif r.pid is not None:
            self._send_agent(r.node, FenceWorker(rank_id, r.pid, "its scale ended", final=True))
        else:  # not started yet: if it starts later, its WorkerStarted finds no rank and fences it
            self._forget_rank(rank_id, f"rank {rank_id} will not start")

    def _forget_rank(self, rank_id: int, message: str) -> None:
        self.ranks.pop(rank_id, None)
        self.restart_at.pop(rank_id, None)
        self.delay_s.pop(rank_id, None)
        self.fencing.pop(rank_id, None)
        self.scheduler.draining.discard(rank_id)
        self.metrics.forget_rank(rank_id)
        self._event("retired", message, rank_id)

    def _fail_scale(self, error: str) -> None:
        op = self.scale_op
        assert op is not None
        op.finish("failed", error)
        self._event("scale-failed", f"scale {op.old_ep_size} -> {op.new_ep_size} failed: {error}")
        for r in op.new_ranks:
            if r in self.ranks and r not in self.members and self.ranks[r].state != "retiring":
                self._stop_rank(r)
        self.scheduler.draining -= set(op.retiring)
        for r in op.retiring:
            if r in self.ranks and self.ranks[r].state == "draining":
                self.ranks[r].state = "serving"
        op.retiring = []
        self._publish()

    def _advance_scale(self) -> bool:
        """Move the scale on at a step boundary; True when it changed the epoch."""
        op = self.scale_op
        assert op is not None
        if time.monotonic() - op.started_at > self.cfg.elastic_ep_scale_timeout_s:
            self._fail_scale(f"not serving at {op.new_ep_size} ranks within --elastic-ep-scale-timeout "
                             f"{self.cfg.elastic_ep_scale_timeout_s:g}s; check the new ranks' logs")
            return False
        if op.phase == "pending":
            self._begin_scale(op)
            return False
        return self._advance_scale_up(op) if op.up else self._advance_scale_down(op)

    def _begin_scale(self, op: ScaleOp) -> None:
        intended = self._intended_ranks()
        if op.up:
            rank_nodes = self._rank_nodes()
            op.new_ranks = new_rank_ids(self.ranks, max(op.new_ep_size - len(intended), 0))
            for rank_id in op.new_ranks:
                node = agent_for_new_rank(self.agents, rank_nodes)
                rank_nodes[rank_id] = node
                self.ranks[rank_id] = RankState(rank_id, node)
                self._send_agent(node, StartWorker(rank_id, "initial", self._dense_site(node)))
            op.phase = "joining"
            self._event("scale", f"scale-up {op.old_ep_size} -> {op.new_ep_size}: starting ranks {op.new_ranks}")
        else:
            op.retiring = ranks_to_retire(intended, len(intended) - op.new_ep_size)
            for rank_id in op.retiring:
                if rank_id not in self.members:  # down and waiting for a restart: nothing to drain
                    self._forget_rank(rank_id, f"rank {rank_id} retired while down")
            op.retiring = [r for r in op.retiring if r in self.members]
            for rank_id in op.retiring:
                self.ranks[rank_id].state = "draining"
            self.scheduler.draining |= set(op.retiring)
            op.drain_deadline = time.monotonic() + self.cfg.scale_drain_timeout_s
            op.phase = "draining"
            self._event("scale", f"scale-down {op.old_ep_size} -> {op.new_ep_size}: draining ranks {op.retiring}")
        self._publish()

    def _advance_scale_up(self, op: ScaleOp) -> bool:
        registered = [r for r in op.new_ranks if self.ranks[r].hello is not None]
        if len(registered) < len(op.new_ranks):
            op.phase = "waiting_for_cohort" if registered else "joining"
            return False
        op.phase = "configuring_data_plane"
        self._publish()
        live = sorted(set(self.members) | set(op.new_ranks) | set(self._joiners()))
        self._change_epoch(live, f"scale-up to {len(live)} ranks", self._load_estimate())
        if all(self.ranks[r].state == "serving" for r in op.new_ranks):
            op.phase = "syncing_new_world"
            op.finish("serving_expanded")
            self.target_ep_size = op.new_ep_size
            self._event("scale", f"serving at {len(self.members)} ranks {op.finished_s:.2f}s after the request")
            self._publish()
        return True

    def _advance_scale_down(self, op: ScaleOp) -> bool:
        busy = [r for r in op.retiring if self.scheduler.num_requests(r)]
        if op.phase == "draining" and busy and time.monotonic() < op.drain_deadline:
            return False
        if op.phase == "draining":
            drained_s = time.monotonic() - op.drain_deadline + self.cfg.scale_drain_timeout_s
            self._event("drained", f"ranks {op.retiring} drained in {drained_s:.2f}s; {len(busy)} of them still "
                        f"ran requests, which move to the staying ranks", moved_from=busy)
        op.phase = "retiring"
        self._publish()
        keep = [r for r in self.members if r not in op.retiring]
        load = self._load_estimate()
        if op.retiring:
            # The leaving ranks stay in this epoch only to send the experts no one else holds.
            self._change_epoch(list(self.members), f"scale-down: moving experts off ranks {op.retiring}", load,
                               holding=keep)
            self._change_epoch(keep, f"scale-down to {len(keep)} ranks", load, new=trimmed(self.location, max(self.cfg.ep_size, max(keep) + 1)))
        for r in op.retiring:
            self._stop_rank(r)
        op.finish("serving_shrunk")
        self.target_ep_size = op.new_ep_size
        self._event("scale", f"serving at {len(self.members)} ranks {op.finished_s:.2f}s after the request")
        self._publish()
        return True

    # ---- snapshot for HTTP -------------------------------------------------------------

    def _publish(self, throttle_s: float = 0.0) -> None:
        now = time.monotonic()
        if throttle_s and now - self._published_at < throttle_s:
            return
        self._published_at = now
        ranks = [
            r.view(self.location, self.slots_per_rank * self.num_moe_layers,
                   self.scheduler.num_requests(r.rank_id), self.delay_s.get(r.rank_id, 0.0), now)
            for r in sorted(self.ranks.values(), key=lambda r: r.rank_id)
        ]
        self._snapshot = {
            "time_s": time.time(), "epoch": self.epoch, "ep_size": len(self.members), "members": list(self.members),
            "controller": self.health_addr,
            "slots_per_rank": self.slots_per_rank, "ranks": ranks,
            "ready": self._ready.ready, "reason": self._ready.reason,
            "deadlines": {**self.cfg.deadlines(), "watchdog_deadline_s": round(self.watchdog_deadline_s(), 3)},
            "step": self.step, "scale": self.scale_status(),
            "placement": json.loads(self.location.to_json()) if self.location is not None else None,
            "events": list(self.events)[-50:],
        }

    # ---- Engine ------------------------------------------------------------------------

    def readiness(self) -> Readiness:
        return self._ready

    def cluster(self) -> dict[str, Any]:
        return self._snapshot

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if len(request.prompt_token_ids) >= self.cfg.max_model_len:
            raise ElasticEPError(
                f"prompt has {len(request.prompt_token_ids)} tokens but --max-model-len is "
                f"{self.cfg.max_model_len} (prompt plus at least one generated token); shorten the prompt"
            )
        deadline = time.monotonic() + self.cfg.admission_timeout_s
        while not self._ready.ready:
            if time.monotonic() > deadline or self.fatal:
                raise ServiceUnavailable(f"not ready: {self._ready.reason}", retry_after_s=5)
            await asyncio.sleep(0.05)
        seq = Sequence(next(self._ids), request, self.cfg.max_model_len, self.info.eos_token_ids)
        stream = _Stream(request.request_id, asyncio.get_running_loop(), asyncio.Queue())
        self._command("add", seq, stream)
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._command("abort", seq.seq_id)

    def start_expert_distribution_record(self) -> None:
        self.recorder.start()

    def stop_expert_distribution_record(self) -> None:
        self.recorder.stop()

    def dump_expert_distribution_record(self) -> dict[str, Any]:
        return self.recorder.dump(self.cfg.record_dir)

    def scale(self, new_ep_size: int) -> dict[str, Any]:
        with self._scale_lock:
            old = len(self.members)
            limits = scale_limits(self.config.num_experts, self.slots_per_rank, self.cfg.max_ranks)
            check_target(new_ep_size, old, limits, self.scale_op)
            if self.fatal:
                raise ScaleRejected(f"the cluster stopped: {self.fatal}", 409)
            if self.epoch < 0:
                raise ScaleRejected("the cluster is still starting; retry once GET /ready answers 200", 409)
            self.scale_op = ScaleOp(old, new_ep_size)
        self._wake()
        return {"old_ep_size": old, "new_ep_size": new_ep_size}

    def scale_status(self) -> dict[str, Any]:
        return status_view(self.scale_op, len(self.members))

    def chaos(self, action: str, rank_id: int, delay_s: float = 0.0) -> dict[str, Any]:
        if not self.cfg.enable_chaos:
            raise ElasticEPError("fault injection is off; start the server with --enable-chaos")
        ranks = {r["rank_id"]: r for r in self._snapshot["ranks"]}
        if ranks.get(rank_id, {}).get("pid") is None:
            raise ElasticEPError(f"no rank {rank_id}; ranks are {sorted(ranks)}")
        signals = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "resume": signal.SIGCONT}
        if action in signals:
            self._command("signal", rank_id, signals[action])
        elif action == "slow":
            if delay_s < 0:
                raise ElasticEPError(f"delay_s must be >= 0, got {delay_s}")
            self._command("slow", rank_id, delay_s)
        else:
            raise ElasticEPError(f"unknown chaos action {action!r}; use kill, hang, resume or slow")
        return {"action": action, "rank_id": rank_id, "pid": ranks[rank_id]["pid"], "delay_s": delay_s}


def _cause_kind(cause: str) -> str:
    for kind in ("exited", "heartbeat", "hung", "no answer", "did not join"):
        if kind in cause:
            return kind.replace(" ", "_")
    return "other"

