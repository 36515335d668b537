"""Node agents and the rank processes they run: welcome an agent and give it ranks, follow each
process from start to exit, fence, stop or restart a rank, and the node backups.

When a rank's process dies its agent reports the exit at once and it becomes a fault (unless
the rank was leaving); when it is fenced the agent kills it and confirms. A down rank is started
again after --restart-delay-s by its agent (or by the agent itself with --auto-recover), or by
a replacement node's agent (`--join-mode recover`). When an agent goes, its backup goes with
it and transfers are no longer planned from it.

Agents say they are alive every 0.1 s and each answer renews their lease. An agent silent for
--agent-timeout-s (its host lost, or cut off) is dropped: every rank of its node is a fault at
once, and since no one can kill them from here they count as down without a confirmation (a
cut-off node fences itself when its lease runs out). When it comes back it registers again,
in recover mode, and its ranks rejoin; anything from the session given up on is answered
with `SessionEnded`, and a process it reports started is not taken. Until the first alive of a
session (which waits for the welcome: after a heal the link may hold that back for a second or
more) the agent's repeated hellos are its word, and it is allowed `AGENT_HELLO_INTERVAL_S` more
silence, so a session is not given up on before its welcome could reach it.

In a controller group a new leader's agents register in adopt mode, naming the workers they
run: each becomes this controller's rank as it is (`_adopt`), and registers once it follows the
new leader (`WorkerHello` join_mode adopt, its weights neither loaded nor counted again);
membership/adoption.py forms the epoch that adopts them.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import psutil
from msgspec.structs import replace

from elastic_ep.errors import ElasticEPError
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import (
    AGENT_HELLO_INTERVAL_S,
    AbortEpoch,
    AgentAlive,
    AgentBye,
    AgentHello,
    AgentShutdown,
    AgentWelcome,
    BackupAssign,
    BackupReady,
    FenceWorker,
    LeaseRenew,
    NodeHeartbeat,
    Progress,
    SessionEnded,
    Shutdown,
    SignalWorker,
    StartWorker,
    WorkerExited,
    WorkerFenced,
    WorkerHello,
    WorkerLaunch,
    WorkerStarted,
    WorkerStartFailed,
    exit_reason,
)

from ..cluster import ClusterState
from ..config import ServeConfig
from ..control_plane import ControlPlane
from ..events import EventKind
from ..faults.detector import Fault, FaultCause, FaultDetector
from ..ranks import AgentInfo, RankInfo, RankStatus
from .backup_shares import backup_shares


def device_kind(device: str) -> str:
    """"cuda:1" -> "cuda"."""
    return device.split(":")[0]


def wrong_device(group_kind: str, hello: WorkerHello) -> str:
    """Why a registering rank cannot join a group that computes on `group_kind` ("" when it can):
    every rank of a group computes on one device kind."""
    kind = device_kind(hello.device)
    if kind == group_kind:
        return ""
    return (f"rank {hello.rank_id} on {hello.node} came up on {kind}, but the group runs on {group_kind} "
            f"(--device auto found no GPU there?): fix that node, or pass --device {group_kind}")


class Nodes:
    """The one writer of agents, rank processes (their records, pids and process states),
    restarts and backups. Built with the cluster state, the control plane it sends on, the store
    port workers are launched with, an expert's bytes (for the backup's size) and the callables
    `fault(Fault)`, `target_size()` (ranks the group is meant to have), `undrain(rank_ids)`
    (the scheduler), `forget_measures(rank_id)` (metrics and timings of a rank that left),
    `pump(timeout_s)`, `publish()` and `set_pool_size(rank_id, blocks)` (the scheduler's KV pools)."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, plane: ControlPlane, store_port: int,
                 expert_nbytes: int, *, fault: Callable[[Fault], None], target_size: Callable[[], int],
                 undrain: Callable[[list[int]], None], forget_measures: Callable[[int], None],
                 pump: Callable[[float], None], publish: Callable[[], None],
                 set_pool_size: Callable[[int, int], None], read_rate_path: str = ""):
        self.cluster = cluster
        self.cfg = cfg
        self.plane = plane
        self.store_port = store_port
        self.expert_nbytes = expert_nbytes
        self.fault = fault
        self.target_size = target_size
        self.undrain = undrain
        self.forget_measures = forget_measures
        self.pump = pump
        self.publish = publish
        self.set_pool_size = set_pool_size  # a rank's KV pool blocks, as it says when it registers
        self.options: dict[str, Any] = {}  # WorkerLaunch fields a rolling restart changed (rollout_rules.py)
        self.restart_at: dict[int, float] = {}  # rank -> monotonic time its restart is due
        self.ended: dict[int, str] = {}  # rank -> how its last process ended ("killed by SIGKILL")
        self.read_rate_path = read_rate_path  # the storage throttle's shared file (--load-read-rate-mb-s)
        self.backup_assigned = False

    # ---- agents ------------------------------------------------------------------------------

    def on_agent_hello(self, identity: bytes, msg: AgentHello) -> None:
        known = self.cluster.agents.get(msg.node)
        if known is not None and known.session == msg.session:  # a hello repeated before our welcome arrived
            known.last_alive = self.plane.heard_clock()
            self.plane.to_identity(identity, AgentWelcome(self.launch(), msg.session))
            return
        agent = AgentInfo(msg.node, identity, msg.fetch_addr, msg.num_ranks, msg.auto_recover, msg.session, msg.host,
                          self.plane.heard_clock(), msg.standalone)
        self.cluster.agents[msg.node] = agent
        self.cluster.events.add(EventKind.AGENT, f"node {msg.node} registered ({msg.join_mode}) at {msg.host or '?'}",
                                node=msg.node, join_mode=msg.join_mode)
        self._welcome(agent, msg.join_mode, msg.running)

    def on_agent_alive(self, identity: bytes, msg: AgentAlive) -> None:
        agent = self.cluster.agents.get(msg.node)
        if agent is None or agent.session != msg.session:
            self.plane.to_identity(identity, SessionEnded(msg.session, "the controller gave up on this session "
                                                                           "(unreachable for --agent-timeout-s)"))
            return
        self.heard_from(agent, self.plane.heard_clock())
        agent.zygote = msg.zygote
        self.cluster.loads.agent(msg.node, msg.session, msg.storage_bytes)
        self.plane.to_identity(identity, LeaseRenew(msg.session, self.cfg.lease_s))

    def on_node_heartbeat(self, msg: NodeHeartbeat, heard: float) -> bool:
        """An agent's `NodeHeartbeat`, read at `heard` (heard clock): word from the agent, as an
        `AgentAlive` is (between two of its alives: node/lease.py), when it is of the agent's
        session; False for one of a session given up on (its ranks' beats are not taken either)."""
        agent = self.cluster.agents.get(msg.node)
        if agent is None or agent.session != msg.session:
            return False
        self.heard_from(agent, heard)
        return True

    @staticmethod
    def heard_from(agent: AgentInfo, heard: float) -> None:
        agent.last_alive, agent.stalled, agent.alive_heard = heard, False, True

    def check_agents(self, now: float) -> None:
        """Drop every agent silent for --agent-timeout-s; its node's ranks are faults. Not the
        in-process agent of `serve`: it is a thread of this process, with no host or link of its own
        to lose, so its silence is a stall of that thread (seen on a loaded machine while ranks
        load) and fencing its node for it would be a false fault; its ranks are still judged by
        their own heartbeats and exits. Such a stall is an event, once per silence. An agent that has
        not said alive in its session yet is waiting for its welcome and only repeats its hello:
        it is allowed AGENT_HELLO_INTERVAL_S more."""
        timeout_s = self.cfg.agent_timeout_s
        for agent in [a for a in self.cluster.agents.values()
                      if now - a.last_alive > timeout_s + (0.0 if a.alive_heard else AGENT_HELLO_INTERVAL_S)]:
            if not agent.standalone:
                if not agent.stalled:
                    agent.stalled = True
                    self.cluster.events.add(
                        EventKind.AGENT, f"node {agent.node}: the in-process agent was silent for more than "
                        f"{timeout_s:g}s, a stall of its thread in this process (not a node loss: its ranks "
                        "are judged by their own heartbeats)", node=agent.node)
                continue
            self.cluster.events.add(EventKind.NODE_LOST, f"node {agent.node} lost: no word from its agent for "
                                    f"{timeout_s:g}s (host down or cut off); its ranks fence themselves within "
                                    "their lease", node=agent.node)
            self.drop_backup(agent.node, "its node is lost")
            self.cluster.agents.pop(agent.node)
            for r in self.cluster.ranks.values():
                if r.node == agent.node and r.status == RankStatus.FENCING:  # no one left to confirm it
                    r.status = RankStatus.DEAD
                elif r.node == agent.node and not r.status.down and r.status != RankStatus.RETIRING:
                    self.fault(Fault(r.rank_id, FaultCause.NODE_LOST,
                                         f"node {agent.node} unreachable (no agent heartbeat for {timeout_s:g}s)"))

    def _welcome(self, agent: AgentInfo, join_mode: str, running: Iterable[tuple[int, int]] = ()) -> None:
        """Give a new agent its ranks: free rank ids, or with join_mode recover (a node that comes
        back, or a replacement) ranks that are down, its own first, which it starts again; with
        join_mode adopt the `running` (rank_id, pid) it names, as they are (a new leader's agent)."""
        c = self.cluster
        self.plane.to_identity(agent.identity, AgentWelcome(self.launch(), agent.session))
        if join_mode == "adopt":
            for rank_id, pid in running:
                self._adopt(agent, rank_id, pid)
            return
        if agent.node in c.cordoned:
            c.events.add(EventKind.AGENT, f"node {agent.node} is cordoned: no rank starts there until "
                         "POST /uncordon", node=agent.node)
            return
        if join_mode == "recover":
            down = sorted(c.down_ranks(), key=lambda r: (c.ranks[r].node != agent.node, r))
            for rank_id in down[: agent.num_ranks]:
                self.restart_at.pop(rank_id, None)
                c.ranks[rank_id].node = agent.node
                c.events.add(EventKind.REPLACE, f"rank {rank_id} moves to node {agent.node}", rank_id)
                self.plane.to_identity(agent.identity, self._start_worker(rank_id, "recover", agent.node))
            return
        free = [r for r in range(self.target_size()) if r not in c.ranks]
        for rank_id in free[: agent.num_ranks]:
            c.ranks[rank_id] = RankInfo(rank_id, agent.node)
            self.plane.to_identity(agent.identity, self._start_worker(rank_id, "initial"))

    def _adopt(self, agent: AgentInfo, rank_id: int, pid: int) -> None:
        """A worker an agent runs from the last leader's time becomes this controller's rank (starting
        until it registers here), unless another process holds that rank id: then it is stopped."""
        c = self.cluster
        known = c.ranks.get(rank_id)
        if known is not None and not known.status.down and known.pid != pid:
            why = f"rank {rank_id} runs elsewhere (pid {known.pid} on {known.node})"
            self.plane.to_identity(agent.identity, FenceWorker(rank_id, pid, why, final=True))
            return
        heard = self.plane.heard_clock()
        self.restart_at.pop(rank_id, None)
        c.ranks[rank_id] = RankInfo(rank_id, agent.node, pid, RankStatus.STARTING, heard, progress_at=heard)
        c.events.add(EventKind.ADOPTED, f"rank {rank_id} on {agent.node} (pid {pid}) adopted as it runs", rank_id,
                     pid=pid)

    def launch(self) -> WorkerLaunch:
        """What workers start with: the serve flags, with the options of the last rolling restart."""
        cfg, plane = self.cfg, self.plane
        return replace(WorkerLaunch(
            cfg.model_dir, plane.step_addr, plane.health_addr, cfg.control_host, self.store_port, cfg.backend,
            cfg.max_num_seqs, cfg.max_model_len, cfg.heartbeat_interval_s if cfg.health_checks else 0.0,
            cfg.backup_fetch_timeout_s, dtype=cfg.dtype, device=cfg.device, block_size=cfg.block_size,
            num_gpu_blocks_override=cfg.num_gpu_blocks_override, kv_cache_memory=cfg.kv_cache_memory,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            expert_slot_bytes=self.cluster.slots_per_rank * self.cluster.num_layers * self.expert_nbytes,
            max_num_batched_tokens=cfg.max_num_batched_tokens, read_once=cfg.read_once and cfg.expert_backup,
            read_rate_mb_s=cfg.load_read_rate_mb_s, read_rate_path=self.read_rate_path, plan_addr=plane.plan_addr,
        ), **self.options)

    def _start_worker(self, rank_id: int, join_mode: str, dense_node: str | None = None) -> StartWorker:
        """The order to start a rank, dense weights from a host-memory copy near `dense_node` (None:
        disk); it carries the launch once a rolling restart changed it (the agent keeps it)."""
        site = self.cluster.dense_site(dense_node) if dense_node is not None and "model_dir" not in self.options \
            else None
        return StartWorker(rank_id, join_mode, site, self.launch() if self.options else None)

    def on_agent_bye(self, msg: AgentBye) -> None:
        agent = self.cluster.agents.get(msg.node)
        if agent is None or agent.session != msg.session:  # an earlier agent process's, come late
            return
        self.drop_backup(msg.node, "its agent stopped")
        self.cluster.agents.pop(msg.node, None)

    def send(self, node: str, message) -> None:
        agent = self.cluster.agents.get(node)
        if agent is not None:
            self.plane.to_identity(agent.identity, message)

    # ---- rank processes ------------------------------------------------------------------------

    def on_worker_started(self, identity: bytes, msg: WorkerStarted) -> None:
        agent = self.cluster.agents.get(msg.node)
        if agent is None or agent.session != msg.session:  # started in a session given up on: it fences it
            return
        r = self.cluster.ranks.get(msg.rank_id)
        if r is None or r.status == RankStatus.RETIRING:  # it left the cluster (its scale ended) before it started
            self.plane.to_identity(identity, FenceWorker(msg.rank_id, msg.pid, "it left the cluster", final=True))
            return
        heard = self.plane.heard_clock()
        r.node, r.pid, r.status, r.last_heartbeat = msg.node, msg.pid, RankStatus.STARTING, heard
        r.progress, r.progress_at, r.hello = Progress(), heard, None
        how = "forked from the node's zygote" if msg.started_by == "fork" else "by exec"
        self.cluster.events.add(EventKind.STARTED, f"rank {msg.rank_id} started on {msg.node} (pid {msg.pid}, {how})",
                                msg.rank_id)

    def on_worker_hello(self, msg: WorkerHello) -> None:
        """A rank registered: it may join an epoch from now on. One that computes on another device
        kind than the group is refused: at startup the whole server stops with the reason
        (ElasticEPError), later that rank is stopped for good."""
        c = self.cluster
        r = c.ranks.get(msg.rank_id)
        if r is None or r.pid != msg.pid:  # not the process this rank's agent reported started
            return
        c.device_kind = c.device_kind or device_kind(msg.device)
        reason = wrong_device(c.device_kind, msg)
        if reason:
            if c.epoch < 0:
                raise ElasticEPError(reason)
            c.events.add(EventKind.REFUSED, f"{reason}; the rank is stopped", msg.rank_id)
            self.stop_rank(msg.rank_id)
            return
        r.hello, r.last_heartbeat = msg, self.plane.heard_clock()
        self.set_pool_size(msg.rank_id, msg.kv_blocks)
        cfg = self.cfg
        if msg.join_mode == "adopt":  # it loaded nothing now (no load counted): its weights are those it ran with
            self.cluster.events.add(
                EventKind.REGISTERED, f"rank {msg.rank_id} registered (adopt): it runs on with its weights, slots and "
                f"KV pool of {msg.kv_blocks} blocks (epoch {msg.held_epoch} held whole)", msg.rank_id,
                kv_blocks=msg.kv_blocks, held_epoch=msg.held_epoch)
            return
        c.loads.dense(msg.node, msg.dense_source, msg.dense_bytes)
        self.cluster.events.add(
            EventKind.REGISTERED, f"rank {msg.rank_id} registered ({msg.join_mode}); dense weights from "
            f"{msg.dense_source} in {msg.load_s:.2f}s, warmed up in {msg.warmup_s:.3f}s; KV pool of {msg.kv_blocks} "
            f"blocks of {cfg.block_size} tokens ({msg.kv_blocks * cfg.block_size} tokens, "
            f"{msg.kv_blocks * cfg.block_size // cfg.max_model_len} requests of --max-model-len {cfg.max_model_len})",
            msg.rank_id, dense_source=msg.dense_source, load_s=msg.load_s, warmup_s=msg.warmup_s,
            kv_blocks=msg.kv_blocks)

    def on_worker_exited(self, msg: WorkerExited) -> None:
        r = self.cluster.ranks.get(msg.rank_id)
        if r is None or r.pid != msg.pid:
            return
        self._ended(r, exit_reason(msg.returncode), FaultDetector.exited(msg.rank_id, msg.returncode))

    def on_worker_start_failed(self, msg: WorkerStartFailed) -> None:
        """The agent could not start the rank's process: as if it had started and exited at once. A
        rank that was down already (its restart failed) is restarted again after --restart-delay-s."""
        agent = self.cluster.agents.get(msg.node)
        r = self.cluster.ranks.get(msg.rank_id)
        if agent is None or agent.session != msg.session or r is None or r.node != msg.node:
            return
        how = f"could not be started on {msg.node}: {msg.reason}"
        self.cluster.events.add(EventKind.START_FAILED, f"rank {msg.rank_id} {how}", msg.rank_id, node=msg.node,
                                reason=msg.reason)
        if r.status.down:
            self.ended[msg.rank_id] = how
            self.schedule_restart(msg.rank_id)
            return
        self._ended(r, how, Fault(msg.rank_id, FaultCause.EXITED, f"process {how}"))

    def _ended(self, r: RankInfo, how: str, fault: Fault) -> None:
        """Rank `r`'s process ended (`how`, for people): a fault, unless the rank was leaving."""
        self.ended[r.rank_id] = how
        if r.status != RankStatus.RETIRING:
            self.fault(fault)
        if r.status == RankStatus.RETIRING:  # also when the fault above failed a scale it was joining
            self.forget_rank(r.rank_id, f"rank {r.rank_id} stopped ({how})")
            return
        r.status = RankStatus.DEAD

    def on_worker_fenced(self, msg: WorkerFenced) -> None:
        r = self.cluster.ranks.get(msg.rank_id)
        if r is None or r.pid != msg.pid:
            return
        if r.status == RankStatus.RETIRING:
            self.forget_rank(msg.rank_id, f"rank {msg.rank_id} stopped")
        elif r.status == RankStatus.FENCING:
            r.status = RankStatus.FENCED

    def fence(self, rank_id: int, reason: str) -> None:
        """Have the rank's agent SIGKILL it (confirmed by `WorkerFenced`); a rank whose node is
        unreachable counts as down at once: it fences itself when its agent's lease runs out."""
        r = self.cluster.ranks[rank_id]
        if r.node not in self.cluster.agents:
            r.status = RankStatus.DEAD
            self.cluster.events.add(EventKind.FENCING, f"rank {rank_id} on unreachable node {r.node} counts as down; "
                                    "it fences itself within its lease", rank_id)
            return
        self.send(r.node, FenceWorker(rank_id, r.pid, reason))
        r.status = RankStatus.FENCING

    def signal(self, rank_id: int, sig: int) -> None:
        r = self.cluster.ranks.get(rank_id)
        if r is not None and r.pid is not None:
            self.send(r.node, SignalWorker(rank_id, r.pid, sig))

    def abort_epoch(self, rank_ids: Iterable[int], epoch: int) -> None:
        """Tell the heartbeat threads of `rank_ids`, through their agents (one `AbortEpoch` a node),
        to give up the collectives of `epoch` (a failed epoch)."""
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank_id in rank_ids:
            if (r := self.cluster.ranks.get(rank_id)) is not None:
                by_node[r.node].append(rank_id)
        for node, ids in by_node.items():
            self.send(node, AbortEpoch(epoch, ids))

    def confirm_lost(self, rank_id: int) -> None:
        """A fence its agent never confirmed: the rank counts as dead."""
        self.cluster.ranks[rank_id].status = RankStatus.DEAD

    def start_new_rank(self, rank_id: int, node: str, spare: bool = False) -> None:
        """A new rank process on `node` (dense weights from a host-memory copy where one exists);
        it registers, then joins or, as a `spare`, stands by."""
        c = self.cluster
        c.ranks[rank_id] = RankInfo(rank_id, node, spare=spare)
        self.send(node, self._start_worker(rank_id, "initial", node))

    def retire(self, rank_id: int, reason: str) -> None:
        """Stop a rank outside the group for good (its exit report removes it), never a fault."""
        r = self.cluster.ranks[rank_id]
        r.status = RankStatus.RETIRING
        if r.pid is not None:
            self.send(r.node, FenceWorker(rank_id, r.pid, reason, final=True))

    def restarting(self, rank_id: int) -> bool:
        """Down and due to be started again."""
        return rank_id in self.restart_at

    def stop_rank(self, rank_id: int) -> None:
        """Stop a rank that leaves the cluster; its exit report removes it from /cluster."""
        r = self.cluster.ranks[rank_id]
        r.status = RankStatus.RETIRING
        self.undrain([rank_id])
        if r.hello is not None:
            self.plane.to_worker(rank_id, Shutdown())
        elif r.pid is not None:
            self.send(r.node, FenceWorker(rank_id, r.pid, "its scale ended", final=True))
        else:  # not started yet: if it starts later, its WorkerStarted finds no rank and fences it
            self.forget_rank(rank_id, f"rank {rank_id} will not start")

    def forget_rank(self, rank_id: int, message: str) -> None:
        c = self.cluster
        gone = c.ranks.pop(rank_id, None)
        self.restart_at.pop(rank_id, None)
        self.undrain([rank_id])
        self.forget_measures(rank_id)
        c.events.add(EventKind.RETIRED, message, rank_id)
        if gone is not None:
            self.release_if_drained(gone.node)

    def release_if_drained(self, node: str) -> None:
        """A cordoned node with no rank left: its agent, when it runs as `elastic-ep agent`, is told
        to stop (it exits 0). The agent inside `elastic-ep serve` stays: it is the controller's."""
        c = self.cluster
        agent = c.agents.get(node)
        if node not in c.cordoned or agent is None or not agent.standalone:
            return
        if any(r.node == node for r in c.ranks.values()):
            return
        c.events.add(EventKind.AGENT, f"node {node} is drained: no rank left; its agent stops", node=node)
        self.plane.to_identity(agent.identity, AgentShutdown())

    def restart_due(self, now: float) -> None:
        """Ask agents to start the down ranks whose --restart-delay-s has passed."""
        c = self.cluster
        for rank_id, t in list(self.restart_at.items()):
            node = c.ranks[rank_id].node
            if now >= t and node in c.agents:  # an unreachable node restarts its ranks when it registers again
                del self.restart_at[rank_id]
                self.send(node, self._start_worker(rank_id, "recover", node))

    def schedule_restart(self, rank_id: int) -> None:
        """After a fault: restart it after --restart-delay-s unless its agent restarts its own ranks."""
        agent = self.cluster.agents.get(self.cluster.ranks[rank_id].node)
        if self.cfg.restart_delay_s >= 0 and not (agent is not None and agent.auto_recover):
            self.restart_at[rank_id] = time.monotonic() + self.cfg.restart_delay_s

    def shutdown(self) -> None:
        for r in self.cluster.ranks.values():
            if not r.status.down:
                self.plane.to_worker(r.rank_id, Shutdown())
        for agent in self.cluster.agents.values():
            self.plane.to_identity(agent.identity, AgentShutdown())

    # ---- host-memory backup --------------------------------------------------------------------

    def start_backup(self, location: ExpertLocation | None = None) -> None:
        """Give every agent its share of the expert backup for `location` (default: the current
        placement), if memory allows; once."""
        c, cfg = self.cluster, self.cfg
        if self.backup_assigned:
            return
        self.backup_assigned = True
        total = self.expert_nbytes * c.num_layers * c.num_experts
        room = psutil.virtual_memory().available
        if not cfg.expert_backup:
            c.backup_off = "the expert backup is off (--no-expert-backup)"
        elif total > room // 2:
            c.backup_off = f"the expert backup is off: {total} bytes exceed half the free memory ({room})"
        else:
            c.backup_off = ""
        if c.backup_off:
            c.events.add(EventKind.BACKUP, c.backup_off)
            return
        location = location or c.location
        assert location is not None
        for node, items in backup_shares(location, c.rank_nodes(), sorted(c.agents)).items():
            c.backup_progress[node] = (0, len(items))
            self.plane.to_identity(c.agents[node].identity, BackupAssign(items, c.device_kind or "cpu"))

    def on_backup_ready(self, msg: BackupReady) -> None:
        """A piece of a node's backup is written: plan transfers from it at once. Only from the node's
        current agent session: a piece of another (a previous agent process's, come late) names a
        file that process may have taken with it."""
        c = self.cluster
        agent = c.agents.get(msg.node)
        if agent is None or agent.session != msg.session or msg.node in c.backup_lost:
            return
        agent.backup = msg.site
        agent.backup_experts = agent.backup_experts + list(msg.experts)
        if len(agent.backup_experts) < msg.share:
            c.backup_progress[msg.node] = (len(agent.backup_experts), msg.share)
            return
        c.backup_progress.pop(msg.node, None)
        c.events.add(EventKind.BACKUP, f"node {msg.node} holds {len(agent.backup_experts)} experts in host memory "
                     f"({msg.nbytes} bytes)", nbytes=msg.nbytes, path=msg.site.path)

    def wait_for_ranks(self, stopping: threading.Event) -> None:
        """Until --ep-size ranks have registered (the first epoch forms over them). Raises
        ElasticEPError when a rank exits first or --startup-timeout-s runs out."""
        c, cfg = self.cluster, self.cfg
        deadline = time.monotonic() + cfg.startup_timeout_s
        while not stopping.is_set():
            hello = [r for r in c.ranks.values() if r.hello is not None]
            c.set_readiness(False, f"starting: {len(hello)}/{cfg.ep_size} ranks registered")
            self.publish()
            if len(hello) >= cfg.ep_size:
                return
            dead = [r for r in c.ranks.values() if r.status == RankStatus.DEAD]
            if dead:
                how = f" ({self.ended[dead[0].rank_id]})" if dead[0].rank_id in self.ended else ""
                raise ElasticEPError(f"rank {dead[0].rank_id} ended during startup{how}; its own lines in the log "
                                     "above say why (a worker prints its error before it exits)")
            if time.monotonic() > deadline:
                raise ElasticEPError(
                    f"only {len(hello)} of {cfg.ep_size} ranks registered within --startup-timeout-s "
                    f"{cfg.startup_timeout_s}; check the worker logs"
                )
            self.pump(0.05)

    def drop_backup(self, node: str, why: str) -> None:
        """Stop planning transfers from a node's backup (and dense weights from it)."""
        agent = self.cluster.agents.get(node)
        if agent is not None and agent.backup is not None:
            agent.backup, agent.backup_experts = None, []
            self.cluster.backup_progress.pop(node, None)
            self.cluster.backup_lost[node] = why
            self.cluster.events.add(EventKind.BACKUP_LOST, f"node {node}'s backup is gone: {why}", node=node)
