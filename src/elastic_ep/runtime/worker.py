"""One EP rank: `python -m elastic_ep.runtime.worker '<WorkerArgs json>'`.

Threads:
- main: registers, then runs what the controller sends on the step socket: `EpochStart`
  (form the group or keep it, fill the expert slots, checksum the ones it filled, report),
  `StepPlan` (attention on its own sequences, EP MoE with the epoch's group, sampling; the
  sequences' state between steps, and the compact decode rows that rely on it, in held.py),
  `ResendResult` (the answer of its last step sent again, when the controller never got it),
  `SweepSlots` (checksum a few slots between steps), `WarmUp` (the readiness gate: the batch
  shapes it asks through the epoch's MoE, with a token on every slot; the slots an epoch fills
  each compute once as the epoch forms, runtime/warmth.py), `SleepRank` / `WakeRank` (free the KV
  cache, and at level 2 the weights, then build them again), and from a server with
  --enable-chaos `ChaosStep` (the next step's injected delay and failures) and `CorruptSlot`.
  It blocks inside collectives. With a `WorkerArgs.result_addr` (`--step-results-via agent`) its
  `StepResult`s go to its agent on loopback, which sends the controller its node's results of a
  step in one frame; an answer sent again on `ResendResult`, and every `StepFailed`, go on the
  step socket. With a `WorkerArgs.plan_relay_addr` (`--step-plans-via agent`) its plans may also
  come as its node's `NodeStepPlans`, which the agent relays as the controller sealed it (the MAC
  and term are checked here, as on the step socket): it takes its own plan out and runs it as one
  of the step socket; which plans run, wait for their epoch or are dropped is plan_order.py's.
- heartbeat: its own ZeroMQ socket to its agent's beat socket on loopback (`WorkerArgs.beat_addr`);
  sends `Heartbeat` with the main thread's progress every `heartbeat_interval_s`, which the
  agent forwards in its node's `NodeHeartbeat`, so the controller sees which collective the rank
  waits in even while the main thread is blocked, and sees the rank's last heartbeat age once the
  process is stopped; and takes the `AbortEpoch` the agent relays. Loopback TCP, not ipc: a cut
  of the rank's links (node/netcut.py, packets of its cgroup) silences it to its agent too. It
  runs under SCHED_RR where the rank may (node/priority.py): a CPU saturated by loading ranks no
  longer keeps it off the run queue for seconds.
- agent link: reads its agent's `NewLeader` on stdin (wire/pipe.py), from before the weights load.
  The controller group has a new leader: the epoch in flight is aborted (a collective the dead
  leader's last step left waiting gives up), and the main thread, back in its loop, connects its
  step socket and its store there and registers again (join_mode "adopt") with its weights, expert
  slots and KV pool as they are,
  naming the sequences whose KV it holds (`HeldKV`: only positions that steps which completed
  wrote, since a step that failed is forgotten from its chunks' start): the new leader adopts it in
  a new epoch and takes that KV over for the journaled requests with those tokens. The heartbeat
  thread beats on to the agent, which follows the leader itself. A rank still loading when its
  leader died (a scale-up's joiner) tries the dead leader's store every `STORE_RETRY_S` until the
  new leader is announced, then registers with that one instead: its load is not lost.

The process dies with its agent (PR_SET_PDEATHSIG), so a crashed server leaves no orphans.
Messages of an epoch other than the current one are dropped (but a step plan of a later epoch,
which may come through the agent before its `EpochStart` on the step socket, waits for it:
plan_order.py), and so is any frame without the cluster key (which its agent hands it in
$ELASTIC_EP_CLUSTER_KEY) or not of its socket.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import msgspec
import numpy as np
import psutil
import torch
import torch.distributed as dist
import zmq

from elastic_ep import __version__
from elastic_ep.errors import ElasticEPError
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.kv_cache import KVCache, pool_num_blocks
from elastic_ep.model.memory import return_freed_memory
from elastic_ep.model.model import MoEForCausalLM, SeqChunk
from elastic_ep.model.read_throttle import ReadThrottle
from elastic_ep.model.sampling import TokenHistory, sample_tokens
from elastic_ep.node.priority import prioritize_this_thread
from elastic_ep.parent_death import end_with_parent
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import (
    AGENT_TO_WORKER,
    CONTROLLER_TO_HEARTBEAT,
    CONTROLLER_TO_WORKER,
    PLAN_MAX_FRAME_BYTES,
    RELAYED_TO_WORKER,
    AbortEpoch,
    ChaosStep,
    ClusterKey,
    ClusterKeyError,
    CorruptSlot,
    EpochFailed,
    EpochReady,
    EpochStart,
    Heartbeat,
    HeldKV,
    HeldSlotMaps,
    Inbox,
    NewLeader,
    NodeStepPlans,
    ResendResult,
    Shutdown,
    SleepRank,
    SleepReply,
    SlotChecksums,
    SlotMapUnusable,
    SlotSource,
    StepErrorKind,
    StepFailed,
    StepPlan,
    StepResult,
    SweepSlots,
    TermFence,
    WakeRank,
    WarmedUp,
    WarmUp,
    WorkerArgs,
    WorkerHello,
    WorkerLaunch,
    key_from_env,
)
from elastic_ep.wire.codec import count_dropped
from elastic_ep.wire.pipe import read_message

from .dense import load_dense
from .devices import rank_devices
from .ep_moe import ExpertParallelMoE, LocalFailure
from .exchange import Links
from .experts import BackupUnreachable, ExpertSlots
from .group import (
    WEDGED,
    AddressNotLocal,
    CollectiveError,
    EpochGroup,
    EpochSuperseded,
    ProgressBoard,
    bind_data_plane,
)
from .held import HeldSequences, StepRun
from .kv_move import move_kv
from .overlap import forward_micro_batches
from .plan_order import PlanOrder, Verdict
from .warmth import slots_to_warm

EMPTY_LOAD = np.zeros((0, 0), dtype=np.int32)  # a StepResult whose plan did not ask for the load
# between tries at a leader's store the worker sees a new leader announced (`NewLeader`) and goes there
STORE_RETRY_S = 1.0
PAD_SEQ = -2  # the step's padding tokens (the warm-up's dummy sequence is -1; the controller numbers from 0)


class Worker:
    def __init__(self, args: WorkerArgs, key: ClusterKey):
        self.args = args
        self.key = key
        self.fence = TermFence()  # both threads': a deposed controller's frames are dropped on either socket
        self.inbox = Inbox("worker_step", CONTROLLER_TO_WORKER, key, args.node, self.fence)
        self.group: EpochGroup | None = None
        self._new_leader: WorkerLaunch | None = None  # set by the agent link, followed by the main thread
        # before the load: a leader that changes while the weights load is followed from the store on
        threading.Thread(target=self._agent_link, name="agent-link", daemon=True).start()
        launch = args.launch
        self.progress = ProgressBoard()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"w{args.rank_id}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(launch.step_addr)
        # its step results to its agent, which gathers its node's into one frame (--step-results-via agent)
        self.result_sock = None
        if args.result_addr:
            self.result_sock = self.ctx.socket(zmq.PUSH)
            self.result_sock.setsockopt(zmq.LINGER, 0)
            self.result_sock.connect(args.result_addr)
        # its node's plans relayed by its agent (--step-plans-via agent); loopback TCP, cut with the rank
        self.plan_sock = None
        self.plan_inbox = Inbox("worker_plans", RELAYED_TO_WORKER, key, args.node, self.fence)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if args.plan_relay_addr:
            self.plan_sock = self.ctx.socket(zmq.SUB)
            self.plan_sock.setsockopt(zmq.LINGER, 0)
            self.plan_sock.setsockopt(zmq.MAXMSGSIZE, PLAN_MAX_FRAME_BYTES)
            self.plan_sock.setsockopt(zmq.SUBSCRIBE, b"")
            self.plan_sock.connect(args.plan_relay_addr)
            self.poller.register(self.plan_sock, zmq.POLLIN)
        self.plan_order = PlanOrder()
        self.device, self.comm_device = rank_devices(launch.device, launch.backend, args.local_index)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this rank's GPU is the current one for all it does
        self.config = MoEConfig.from_pretrained(launch.model_dir)
        self.reader = CheckpointReader(launch.model_dir, self.config, dtype=launch.dtype,
                                       throttle=ReadThrottle(launch.read_rate_path, launch.read_rate_mb_s))
        dense, self.dense_source, self.load_s = load_dense(
            self.reader, args.dense_path, args.dense_addr, launch.dense_fetch_timeout_s, key
        )
        self.dense_bytes = sum(t.numel() * t.element_size() for t in dense.values())
        self.model = MoEForCausalLM(self.config, dense, dtype=self.reader.dtype, device=self.device)
        self.kv, self.warmup_s = self._kv_pool()
        # each sequence's tokens whose KV this rank holds, and what its decode rows leave out
        self.held = HeldSequences()
        self.slots: ExpertSlots | None = None
        self.moe: ExpertParallelMoE | None = None
        # runtime/warmth.py: [L, S] slots whose weights computed since written (None: no slots yet),
        # and the step shapes (tokens, micro-batches) the readiness gate ran in this process
        self.warm_slots: np.ndarray | None = None
        self.steps_run: set[tuple[int, int]] = set()
        # None: a new leader was announced before this one's store was reached; `run` follows it
        self.store = self._connect_store(launch)
        self._pending: list = []
        self._load: np.ndarray | None = None  # expert load summed since it was last reported
        self._chaos: ChaosStep | None = None  # fault injection for the next step (--enable-chaos)
        self._answer: StepResult | StepFailed | None = None  # of the last step run, sent again on ResendResult
        # of the step before it: with serve --send-ahead-steps a rank may have run the next step before
        # the controller asks for this one's answer again
        self._answer_before: StepResult | StepFailed | None = None
        self._not_run: dict[int, str] = {}  # the step's decode rows taken out by `fill_sampled`: seq_id -> why
        self._stop = threading.Event()
        self.sleep_level = 0  # 0 awake; 1 the KV cache freed; 2 the weights dropped too
        self._slept_checksums: dict[tuple[int, int], int] = {}
        self._kv_blocks = (self.kv.num_blocks, self.kv.block_size)  # what a wake builds again
        self.held_epoch = -1  # the epoch whose slots this rank holds whole (-1: none yet, or being changed)
        self.slot_maps = HeldSlotMaps()  # the placements it confirmed last: an EpochStart sends the changes

    def _kv_pool(self) -> tuple[KVCache, float]:
        """The rank's KV pool, sized once (model/kv_cache.py: pool_num_blocks), and the seconds
        its warm-up took. On a GPU without --kv-cache-memory or an override the budget is
        --gpu-memory-utilization of the device, less the weights, every expert slot (redundant
        ones included, so a re-placement never needs more) and the activation peak of a warm-up
        forward at the largest batch (without the routed experts, which arrive with the epoch:
        their activations are not in the peak); elsewhere the warm-up is a short one."""
        launch = self.args.launch
        block_size = launch.block_size
        bytes_per_block = self.model.new_kv_cache(1, block_size).bytes_per_token * block_size
        measure = self.device.type == "cuda" and not launch.num_gpu_blocks_override and not launch.kv_cache_memory
        num_tokens = launch.max_num_batched_tokens if measure else 8
        probe = self.model.new_kv_cache(-(-num_tokens // block_size), block_size)
        if measure:
            torch.cuda.reset_peak_memory_stats(self.device)
        warmup_s = self._warm_up(probe, num_tokens)
        budget = launch.kv_cache_memory
        if measure:
            del probe
            peak = torch.cuda.max_memory_allocated(self.device)
            total = torch.cuda.mem_get_info(self.device)[1]
            budget = int(total * launch.gpu_memory_utilization) - peak - launch.expert_slot_bytes
        num_blocks = pool_num_blocks(
            bytes_per_block, override=launch.num_gpu_blocks_override, budget_bytes=budget,
            fallback_blocks=launch.max_num_seqs * -(-launch.max_model_len // block_size))
        # the step's padding tokens (StepPlan.pad_tokens) write their KV into blocks of their own
        # past the pool the controller hands out: at most a full prefill chunk of them
        self.pad_blocks = list(range(num_blocks, num_blocks + -(-launch.max_num_batched_tokens // block_size)))
        print(f"elastic-ep rank {self.args.rank_id}: KV pool of {num_blocks} blocks of {block_size} tokens "
              f"({num_blocks * block_size} tokens, {num_blocks * bytes_per_block / 2**20:.1f} MiB), "
              f"{num_blocks * block_size // launch.max_model_len} requests of {launch.max_model_len} tokens (a longer "
              "one is refused)",
              file=sys.stderr, flush=True)
        return self.model.new_kv_cache(num_blocks + len(self.pad_blocks), block_size), warmup_s

    def _warm_up(self, cache: KVCache, num_tokens: int, moe: ExpertParallelMoE | None = None,
                 micro_batches: int = 1) -> float:
        """One forward of a dummy sequence, on a cache of its own (no request can read it), so
        that real steps do not pay one-time costs (lazy kernel and allocator set-up). Before the
        rank registers the experts are left out (`moe` None): they arrive with the epoch, whose
        all-to-all must run in step with the group; the readiness gate runs it through the
        epoch's `moe`, in `micro_batches` as a step runs them. Returns seconds."""
        t0 = time.perf_counter()
        warmup_seq = -1  # the controller numbers sequences from 0
        cache.set_blocks(warmup_seq, list(range(cache.num_blocks)))
        chunk = SeqChunk(warmup_seq, [i % self.config.vocab_size for i in range(num_tokens)], 0)
        if moe is None:
            self.model.forward([chunk], cache, lambda layer, x, topk_ids, topk_weights: torch.zeros_like(x))
        else:
            moe.start_step(micro_batches=micro_batches)
            forward_micro_batches(self.model, cache, [chunk], moe, micro_batches)
        return time.perf_counter() - t0

    def _warm_up_group(self, msg: WarmUp) -> None:
        """The readiness gate: one forward of each shape in `msg.shapes` (tokens on this rank), in
        its `msg.micro_batches`, through the epoch's MoE with every (token, choice) sent round
        robin over the group's slots, each on a cache of its own; answers `WarmedUp` with the
        slots that computed."""
        moe = self.moe
        assert moe is not None
        block_size = self.args.launch.block_size
        t0, error, done = time.perf_counter(), "", []
        moe.warm_up(True)
        try:
            for num_tokens, micro_batches in zip(msg.shapes, msg.micro_batches, strict=True):
                self.progress.enter("compute")
                self._warm_up(self.model.new_kv_cache(-(-num_tokens // block_size), block_size), num_tokens, moe,
                              micro_batches)
                done.append(num_tokens)
                self.steps_run.add((num_tokens, micro_batches))
        except CollectiveError as e:
            self.group.destroy()
            error = f"{type(e).__name__}: {e}"
        except LocalFailure as failure:
            error = f"{type(failure.error).__name__}: {failure.error}"
        finally:
            warmed = moe.warm_up(False)
            self.progress.idle()
        self.send(WarmedUp(msg.epoch, self.args.rank_id, done, warmed, round(time.perf_counter() - t0, 4), error))

    def send(self, message) -> None:
        self.sock.send_multipart(self.key.seal(message, self.fence.highest))

    def _receive(self):
        """The next message of the step socket, or this rank's plan out of a node's plans relayed by
        its agent (frames an inbox drops, and node plans with none for this rank, are skipped), or
        None when a new leader is to be followed."""
        while self._new_leader is None:
            ready = dict(self.poller.poll(50))
            if self.plan_sock in ready:
                frames = self.plan_sock.recv_multipart(copy=False)
                plan = self._own_plan(frames, self.plan_inbox.read(frames))
                if plan is not None:
                    return plan
            if self.sock in ready:
                msg = self.inbox.read(self.sock.recv_multipart(copy=False))
                if msg is not None:
                    return msg
        return None

    def _own_plan(self, frames: list, relayed: NodeStepPlans | None) -> StepPlan | None:
        """This rank's plan out of its node's relayed plans, or None (none for it, or its bytes not a
        plan: dropped and counted, and the step it was for is one this rank never ran)."""
        if relayed is None:
            return None
        try:
            return relayed.plan_of(self.args.rank_id)
        except msgspec.DecodeError as e:
            count_dropped(self.plan_inbox.socket, self.args.node, "undecodable", frames, f"its plan: {e}"[:200])
            return None

    def _hello(self, held_kv: list[HeldKV] | None = None) -> None:
        self.send(WorkerHello(self.args.rank_id, self.args.node, os.getpid(), self.args.join_mode,
                              self.dense_source, round(self.load_s, 4), round(self.warmup_s, 4), str(self.device),
                              (self.kv.num_blocks if self.kv is not None else self._kv_blocks[0])
                              - len(self.pad_blocks), __version__,
                              self.dense_bytes, self.progress.current.epoch, self.held_epoch, held_kv or []))

    def run(self) -> None:
        if self.args.launch.heartbeat_interval_s > 0:
            threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
        if self._new_leader is None:  # else the hello goes to the leader announced during the load
            self._hello()
        while True:
            if self._new_leader is not None:
                self._follow(self._new_leader)
                continue
            msg = self._pending.pop(0) if self._pending else self._receive()
            if msg is None:
                continue
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, EpochStart | StepPlan) and self.sleep_level:  # a recovery after a fault while asleep
                self._wake()
            if isinstance(msg, EpochStart):
                if self.group is None or msg.epoch > self.group.epoch:
                    self._start_epoch(msg)
                    for plan in self.plan_order.release(msg.epoch):  # plans that came before their epoch
                        self._plan_arrived(plan)
            elif isinstance(msg, ChaosStep):
                self._chaos = msg
            elif isinstance(msg, StepPlan):
                self._plan_arrived(msg)
            elif isinstance(msg, ResendResult):
                self._resend(msg)
            elif isinstance(msg, WarmUp):
                if self.group is not None and msg.epoch == self.group.epoch and self.group.alive:
                    self._warm_up_group(msg)
            elif isinstance(msg, SleepRank):
                self._sleep(msg.level)
            elif isinstance(msg, WakeRank):
                self._wake()
            elif isinstance(msg, SweepSlots | CorruptSlot):
                if self.slots is not None and self.group is not None and msg.epoch == self.group.epoch:
                    self._slot_request(msg)
            if WEDGED.is_set():  # restarted afresh, as a rank that died, rather than serve on a wedged GPU
                print(f"elastic-ep rank {self.args.rank_id}: an NCCL communicator's abort did not return; exiting "
                      "to be restarted", file=sys.stderr, flush=True)
                os._exit(3)
        self._stop.set()
        if self.group is not None:
            self.group.destroy()

    def _plan_arrived(self, plan: StepPlan) -> None:
        """Run `plan` when it is of this rank's epoch (and its group stands) and not run yet; hold
        one of a later epoch until it starts; drop the rest (plan_order.py)."""
        if self._chaos_for(plan).lose_plan:  # fault injection: as if lost on the way
            return
        group = self.group
        verdict = self.plan_order.admit(plan, group.epoch if group is not None else -1)
        if verdict == Verdict.RUN and group.alive:
            self.plan_order.ran(plan)
            self._step(plan)

    def _agent_link(self) -> None:
        """Read the agent's `NewLeader` orders on stdin until the agent closes it; a frame that is not
        sealed with the cluster key, or of an older term, is dropped (wire/codec.py Inbox)."""
        inbox = Inbox("worker_agent", AGENT_TO_WORKER, self.key, self.args.node, self.fence)
        stdin = sys.stdin.buffer
        while (frames := read_message(stdin)) is not None:
            msg = inbox.read(frames)
            if not isinstance(msg, NewLeader):
                continue
            group = self.group  # the last leader's: read before the main thread may follow and form another
            self._new_leader = msg.launch
            if group is not None:
                group.abort()  # a collective of the last leader's epoch gives up: the main thread follows

    def _follow(self, launch: WorkerLaunch) -> None:
        """Connect the step socket and the store to the new leader and register there again, keeping
        the weights, the slots and the KV pool; the last leader's epoch is left (its group, its pending
        orders, its sequences' numbers: the new leader numbers its own). The hello names the KV held
        (`HeldSequences.held_kv`): the new leader gives the blocks of what it takes over to its own sequences (the
        tokens they already hold come as a prefix hit's do, `ChunkPlan.cached_token_ids`); the rest
        of the pool is free to it."""
        self._new_leader = None
        self._pending = []
        self.plan_order.reset()
        if self.group is not None:
            self.group.destroy()
        # the new leader numbers its epochs past the record it read, which may lag; whatever it numbers
        # comes in its term, and nothing of an older term gets through the fence
        self.group = None
        old = self.args.launch
        if launch.step_addr != old.step_addr:
            self.sock.disconnect(old.step_addr)
            self.sock.connect(launch.step_addr)
        self.args = dataclasses.replace(self.args, launch=launch, join_mode="adopt")
        self.store = self._connect_store(launch)
        if self.store is None:  # a newer leader already: the main loop follows that one
            return
        held = self.held.held_kv(self.kv)
        if self.kv is not None:
            for seq_id in self.held.tokens:
                self.kv.free(seq_id)
        self.held.clear()
        print(f"elastic-ep rank {self.args.rank_id}: following the new leader at {launch.step_addr}; KV held for "
              f"{len(held)} sequences ({sum(len(h.token_ids) for h in held)} positions)", file=sys.stderr, flush=True)
        self._hello(held)

    def _connect_store(self, launch: WorkerLaunch) -> dist.TCPStore | None:
        """The store of the leader `launch` names (`connect_store`), or None once a newer leader is
        announced before it is reached: a joiner still loading when its leader died reaches the new
        leader's store instead of waiting out the dead one's."""
        return connect_store(launch.store_host, launch.store_port, launch.connect_timeout_s,
                             superseded=lambda: self._new_leader is not None)

    def _newer_epoch_arrived(self) -> bool:
        if self._new_leader is not None:  # the leader that announced this epoch is gone
            return True
        while self.sock.poll(0):
            msg = self.inbox.read(self.sock.recv_multipart(copy=False))
            if isinstance(msg, (EpochStart, Shutdown)):
                self._pending = [msg]
                return True
        return False

    def _start_epoch(self, msg: EpochStart) -> None:
        args = self.args
        try:
            phy2log = self.slot_maps.resolve(msg.slot_map)
        except SlotMapUnusable as e:
            self.send(EpochFailed(msg.epoch, args.rank_id, str(e)))
            return
        kept = self.group if msg.reuse_group and self.group is not None and self.group.alive \
            and not self.group.broken and self.group.members == msg.members else None
        if self.group is not None and kept is None:
            self.group.destroy()  # peers that kept theirs fail when it goes, or the controller aborts the epoch
        if msg.reuse_group and kept is None:
            self.send(EpochFailed(msg.epoch, args.rank_id, "asked to keep the epoch's group, which this rank "
                                  "no longer has"))
            return
        self.progress.new_epoch(msg.epoch)
        # the group is this rank's from now on, forming or not: an AbortEpoch for it reaches it
        group = self.group = kept or EpochGroup(msg.epoch, msg.members, args.rank_id, args.launch.backend,
                                                self.comm_device)
        try:
            if kept is None:
                rendezvous_s = group.form(self.store, msg.collective_timeout_s, self._newer_epoch_arrived)
                links = Links.form(group, msg.nodes, msg.all2all_backend, self._newer_epoch_arrived)
            else:  # same members, same hosts: the group and its host subgroups stay as they are
                assert self.moe is not None  # a kept group formed an epoch: its moe was built then
                group.epoch, rendezvous_s, links = msg.epoch, 0.0, self.moe.links
            location = ExpertLocation.from_phy2log(phy2log, msg.slots_per_rank, self.config.num_experts)
            self.progress.enter("transfer")  # from here heartbeats may come late: the controller allows for it
            self.held_epoch = -1  # until this epoch's slots are whole
            if self.slots is None:
                self.slots = ExpertSlots(
                    self.config.moe_layers, msg.slots_per_rank, self.config.moe_intermediate_size,
                    self.config.hidden_size, self.reader.dtype, self.device,
                )
            t0 = time.perf_counter()
            filled = self.slots.apply(
                location.experts_of_rank(args.rank_id),
                msg.sources,
                msg.sends,
                group,
                self.reader,
                msg.backups,
                args.node,
                msg.backup_fetch_timeout_s,
                key=self.key,
            )
            transfer_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            unchecked = [(src.layer, src.slot) for src in msg.sources if (src.layer, src.slot) not in filled.checked]
            checksums = {**filled.checked, **self.slots.checksums(unchecked)}
            verify_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            slots_warmed = self._warm_filled(msg.sources)
            warm_s = time.perf_counter() - t0
            self.moe = ExpertParallelMoE(self.slots, location.log2phy, location.logcnt, links, self.progress,
                                         self.config.moe_layers, location.num_ranks, self.config.top_k)
            self.progress.idle()
            self.held_epoch = msg.epoch
            self.send(EpochReady(msg.epoch, args.rank_id, checksums, filled.source_checksums, filled.stats,
                                 rendezvous_s, transfer_s, verify_s, slots_warmed, round(warm_s, 4),
                                 sorted(self.steps_run)))
            self.slot_maps.confirm(msg.epoch, phy2log)
        except EpochSuperseded:
            group.destroy()
        except BackupUnreachable as e:
            group.destroy()
            self.send(EpochFailed(msg.epoch, args.rank_id, f"{type(e).__name__}: {e}", e.node))
        except Exception as e:  # any failure to form: the controller decides what next
            group.destroy()
            self.send(EpochFailed(msg.epoch, args.rank_id, f"{type(e).__name__}: {e}"))

    def _warm_filled(self, sources: list[SlotSource]) -> int:
        """Run each slot the epoch filled, and any other occupied slot not warm yet, once, on this
        rank alone (runtime/warmth.py), so that no step is the first to run new weights. Returns
        how many slots computed."""
        assert self.slots is not None
        occupied = self.slots.experts >= 0
        warmed = self.warm_slots if self.warm_slots is not None else np.zeros_like(occupied)
        cold = slots_to_warm(warmed, occupied, [(src.layer, src.slot) for src in sources])
        computed = self.slots.run_each(cold)
        self.warm_slots = occupied & (warmed | cold)
        return computed

    def _sleep(self, level: int) -> None:
        """Free the KV cache (level 1; the weights stay in host memory: on the CPU they are
        there already), and at level 2 the dense weights and expert slots too. The controller
        sends this only with no sequence running. Answers `SleepReply` with the resident memory
        before and after."""
        t0, before = time.perf_counter(), _rss_bytes()
        error = ""
        try:
            if self.sleep_level == 0:
                self.kv = None
                self.held.clear()
            if level >= 2 and self.sleep_level < 2:
                if self.slots is not None:
                    self._slept_checksums = self.slots.checksums()
                    self.slots.release()
                self.model = None
                self.warm_slots, self.steps_run = None, set()  # built again on wake: cold
            self.sleep_level = max(self.sleep_level, level)
            return_freed_memory()
        except Exception as e:  # the controller reports it; the rank wakes as usual
            error = f"{type(e).__name__}: {e}"
        self.send(SleepReply(self.args.rank_id, self.sleep_level, before, _rss_bytes(),
                             round(time.perf_counter() - t0, 4), error))

    def _wake(self) -> None:
        """Build what `_sleep` freed: at level 2 the dense weights (the node's host backup this
        rank was started with, else disk) and the expert slots (disk), checked against their
        checksums from before the sleep; then an empty KV cache. A no-op when awake."""
        t0, before = time.perf_counter(), _rss_bytes()
        error = ""
        try:
            if self.sleep_level >= 2:
                dense, _, _ = load_dense(self.reader, self.args.dense_path, self.args.dense_addr,
                                         self.args.launch.dense_fetch_timeout_s, self.key)
                self.model = MoEForCausalLM(self.config, dense, dtype=self.reader.dtype, device=self.device)
                if self.slots is not None:
                    self.slots.reload(self.reader)
                    bad = sorted(k for k, v in self.slots.checksums().items() if self._slept_checksums.get(k) != v)
                    if bad:
                        raise RuntimeError(f"slots (layer, slot) {bad[:5]} do not hold what they held before the sleep")
            if self.sleep_level >= 1:
                assert self.model is not None
                self.kv = self.model.new_kv_cache(*self._kv_blocks)
            self.sleep_level = 0
        except Exception as e:  # stays asleep: a second wake tries again
            error = f"{type(e).__name__}: {e}"
        self.send(SleepReply(self.args.rank_id, self.sleep_level, before, _rss_bytes(),
                             round(time.perf_counter() - t0, 4), error))

    def _step(self, plan: StepPlan) -> None:
        """Run one step and answer `StepResult`, or `StepFailed`: COLLECTIVE when the group broke
        (this rank leaves it, so peers fail fast too), LOCAL when this rank's own computation
        raised (it ran the step's collectives all the same, so the group stays whole)."""
        group, moe = self.group, self.moe
        assert group is not None and moe is not None
        start = time.perf_counter()
        self._not_run = {}
        self.progress.enter("compute", step=plan.step)
        moe.start_step(plan.dispatch_rows, plan.micro_batches)
        chaos = self._chaos_for(plan)
        seq_ids = [c.seq_id for c in plan.chunks] + (plan.decode.seq_ids if plan.decode is not None else [])
        faults = {chaos.poisoned.get(q, "") for q in seq_ids} | {chaos.fail_at}
        moe.fail_in_experts = "experts" in faults
        if "local" in faults:  # the second MoE layer's local computation raises
            moe.fail_local_at = self.config.moe_layers[min(1, len(self.config.moe_layers) - 1)]
        try:
            runs, kv_move_s = self._before_forward(plan, moe, chaos.delay_s)
            logits = forward_micro_batches(self.model, self.kv, [SeqChunk(r.seq_id, r.token_ids, r.start_pos)
                                                                 for r in runs], moe, plan.micro_batches,
                                           self._padding(plan.pad_tokens))
        except CollectiveError as e:
            self.held.forget_failed(self.kv, plan)
            self._fail(plan, StepErrorKind.COLLECTIVE, e)
            return
        except LocalFailure as failure:
            self.held.forget_failed(self.kv, plan)
            self._fail(plan, StepErrorKind.LOCAL, failure.error, failure.in_experts)
            return
        tokens, logprobs, errors = self._sample(runs, logits,
                                                {s for s, at in chaos.poisoned.items() if at == "sampling"})
        if self._not_run:
            errors = {**self._not_run, **errors}
        self.progress.idle()
        c = moe.counters
        step_s = time.perf_counter() - start
        self._answer_before, self._answer = self._answer, StepResult(
            plan.epoch, plan.step, self.args.rank_id, tokens, step_s, step_s - c.dispatch_wait_s - c.combine_wait_s,
            c.dispatch_wait_s, c.combine_wait_s, self._expert_load(c.expert_load, plan.report_load), c.slot_tokens,
            logprobs, errors,
            c.remote_messages, c.remote_bytes, round(kv_move_s, 6),
            sum(len(r.token_ids) for r in runs) + plan.pad_tokens,
        )
        if chaos.lose_result:
            return
        if self.result_sock is not None:  # the agent stays the same whoever leads the controller group
            self.result_sock.send_multipart(self.key.seal(self._answer, self.fence.highest))
        else:
            self.send(self._answer)

    def _resend(self, msg: ResendResult) -> None:
        """The controller never got this rank's answer to (epoch, step): the one kept of the last step
        or of the one before when it is that step, else `StepFailed` NOT_RUN (its plan never came, so
        the step must be run again by all)."""
        for kept in (self._answer, self._answer_before):
            if kept is not None and (kept.epoch, kept.step) == (msg.epoch, msg.step):
                self.send(kept)
                return
        last = self._answer
        self.plan_order.passed(msg.epoch, msg.step)  # a plan of it that comes late (a stalled agent's) never runs
        ran = f"epoch {last.epoch} step {last.step}" if last is not None else "no step"
        self.send(StepFailed(msg.epoch, msg.step, self.args.rank_id, f"never ran epoch {msg.epoch} step {msg.step} "
                             f"(its plan did not arrive; the last step it ran was {ran})", StepErrorKind.NOT_RUN))

    def _padding(self, num_tokens: int) -> SeqChunk | None:
        """The step's padding: `num_tokens` dummy tokens of a sequence of their own, on the pool's
        padding blocks (no request's KV is touched), or None."""
        if not num_tokens:
            return None
        self.kv.set_blocks(PAD_SEQ, self.pad_blocks, num_cached=0)
        return SeqChunk(PAD_SEQ, [i % self.config.vocab_size for i in range(num_tokens)], 0)

    def _expert_load(self, step_load: np.ndarray, report: bool) -> np.ndarray:
        """step_load [L, E] added to the sum; the sum (int32) when the plan asks for it and it is not all
        zeros, else [0, 0]."""
        self._load = step_load.copy() if self._load is None else self._load + step_load
        if not report:
            return EMPTY_LOAD
        load, self._load = self._load, None
        return load.astype(np.int32) if load.any() else EMPTY_LOAD  # a rank with no tokens sends nothing

    def _chaos_for(self, plan: StepPlan) -> ChaosStep:
        """What fault injection asked of this step (nothing unless a `ChaosStep` for it came first)."""
        chaos = self._chaos
        if chaos is not None and (chaos.epoch, chaos.step) == (plan.epoch, plan.step):
            return chaos
        return ChaosStep(plan.epoch, plan.step)

    def _before_forward(self, plan: StepPlan, moe: ExpertParallelMoE, delay_s: float) -> tuple[list[StepRun], float]:
        """Frees, KV moves, cache rows, injected delay; returns what the step runs and the KV
        moves' seconds. An error here (a decode row this rank cannot run among them) runs the
        step's collectives with no tokens and raises LocalFailure."""
        try:
            kv_move_s = 0.0
            held = self.held
            held.start(plan)
            try:
                held.free(self.kv, plan.free)
            finally:  # the peers of a move wait on this rank whatever happened above
                kv_move_s = move_kv(self.kv, self.group, plan.kv_moves, held.tokens)
            held.moved_in(plan.kv_moves, self.args.rank_id)
            self._not_run = held.fill_sampled(plan, self._answer)
            runs = held.runs(plan)
            held.allocate(self.kv, plan)
            if delay_s > 0:
                time.sleep(delay_s)
            return runs, kv_move_s
        except CollectiveError:
            raise
        except Exception as e:
            moe.run_empty(plan.micro_batches)
            raise LocalFailure(e, False) from e

    def _sample(self, runs: list[StepRun], logits: torch.Tensor, poisoned: set[int]):
        """(tokens, logprobs, errors) by seq_id for the runs that sample (those in `poisoned`
        raise, as fault injection asked). When sampling the batch raises, each row is sampled
        alone, so only the sequence at fault gets an error."""
        rows = [(i, r.seq_id) for i, r in enumerate(runs) if r.sample]
        try:
            return (*self._sample_rows(rows, logits, poisoned), {})
        except Exception:
            tokens, logprobs, errors = {}, {}, {}
            for row in rows:
                try:
                    t, lp = self._sample_rows([row], logits, poisoned)
                except Exception as e:
                    errors[row[1]] = f"sampling failed: {type(e).__name__}: {e}"
                    continue
                tokens.update(t)
                logprobs.update(lp)
            return tokens, logprobs, errors

    def _sample_rows(self, rows: list[tuple[int, int]], logits: torch.Tensor, poisoned: set[int]):
        """rows: (row of logits [N, V], its seq_id), each with what the rank keeps of it;
        -> (seq_id -> token, seq_id -> logprobs)."""
        if not rows:
            return {}, {}
        if any(q in poisoned for _, q in rows):
            raise RuntimeError("injected fault: sampling failed")
        kept = [self.held.kept[q] for _, q in rows]
        histories = [TokenHistory(held[: k.prompt_len], held[k.prompt_len :])
                     for (_, q), k in zip(rows, kept, strict=True) for held in (self.held.tokens[q],)]
        out = sample_tokens(logits[torch.tensor([i for i, _ in rows])], [k.params for k in kept],
                            [k.seed for k in kept], histories, self.config.eos_token_ids)
        tokens = {q: t for (_, q), t in zip(rows, out.tokens, strict=True)}
        logprobs = {q: lp for (_, q), lp in zip(rows, out.logprobs, strict=True) if lp is not None}
        return tokens, logprobs

    def _fail(self, plan: StepPlan, kind: StepErrorKind, e: Exception, in_experts: bool = False) -> None:
        if kind == StepErrorKind.COLLECTIVE:
            self.group.destroy()  # this epoch is over for this rank; the controller aborts it for the others
        self.progress.idle()
        detail = "" if isinstance(e, RuntimeError) else traceback.format_exc(limit=3)
        self._answer_before, self._answer = self._answer, StepFailed(
            plan.epoch, plan.step, self.args.rank_id, f"{type(e).__name__}: {e}{detail}", kind, in_experts)
        self.send(self._answer)

    def _slot_request(self, msg: SweepSlots | CorruptSlot) -> None:
        assert self.slots is not None
        if isinstance(msg, CorruptSlot):
            self.slots.corrupt(msg.layer, msg.slot)
            return
        self.send(SlotChecksums(msg.epoch, self.args.rank_id, self.slots.checksums(msg.slots)))

    def _heartbeats(self) -> None:
        """Say where the main thread is every heartbeat_interval_s (to the agent, which forwards
        it), and abort the epoch the controller gave up on (its collectives may wait on a peer
        that will never answer)."""
        if not prioritize_this_thread():
            print(f"elastic-ep rank {self.args.rank_id}: the heartbeat thread keeps an ordinary priority (no "
                  "CAP_SYS_NICE): a saturated CPU may delay it", file=sys.stderr, flush=True)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"h{self.args.rank_id}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.args.beat_addr)  # the agent's: it stays the same whoever leads the controller group
        inbox = Inbox("worker_heartbeat", CONTROLLER_TO_HEARTBEAT, self.key, self.args.node, self.fence)
        pid = os.getpid()
        interval_s = self.args.launch.heartbeat_interval_s
        next_beat = time.monotonic()
        while not self._stop.is_set():
            if sock.poll(max(int((next_beat - time.monotonic()) * 1000), 0)):
                msg = inbox.read(sock.recv_multipart(copy=False))
                group = self.group
                if isinstance(msg, AbortEpoch) and group is not None and group.epoch == msg.epoch:
                    group.abort()
                continue
            sock.send_multipart(self.key.seal(Heartbeat(self.args.rank_id, pid, self.progress.current),
                                                 self.fence.highest))
            next_beat = time.monotonic() + interval_s
        sock.close()


def _rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def connect_store(host: str, port: int, timeout_s: float, superseded: Callable[[], bool] = lambda: False,
                  retry_s: float = STORE_RETRY_S) -> dist.TCPStore | None:
    """The controller's TCPStore (every epoch's rendezvous; its operations time out after timeout_s),
    tried every retry_s for up to timeout_s; None when `superseded()` holds before it is reached (that
    controller is no longer the one to reach). Raises ConnectionError naming the address and the flag
    behind it when it cannot be reached within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not superseded():
        tried_at = time.monotonic()
        try:
            # a plain connect first: a store that is not there costs one quiet try of retry_s, where
            # TCPStore's own retries back off for seconds (and log each one) before it gives up
            socket.create_connection((host, port), timeout=max(min(retry_s, deadline - tried_at), 0.01)).close()
            store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=max(deadline - time.monotonic(), retry_s)))
            store.set_timeout(timedelta(seconds=timeout_s))
            return store
        except (RuntimeError, OSError) as e:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"cannot reach the controller's store at {host}:{port} within {timeout_s:g}s ({e}); this host "
                    "must reach the address `elastic-ep serve` binds (--host / --advertise-host)") from None
            time.sleep(max(min(tried_at + retry_s, deadline) - time.monotonic(), 0))
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    end_with_parent(signal.SIGKILL)
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    args = WorkerArgs.from_json(argv[0])
    try:
        key = key_from_env()
        bind_data_plane(args.host)
        worker = Worker(args, key)
    except (AddressNotLocal, ConnectionError, ElasticEPError, ClusterKeyError) as e:
        print(f"elastic-ep rank {args.rank_id} on {args.node}: {e}", file=sys.stderr, flush=True)
        return 2
    worker.run()
    # Out without the interpreter's teardown: a gloo group kept because a peer may never answer
    # (group.destroy) aborts the process in its destructor, and a context's term waits on linger.
    worker.sock.close(linger=1000)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
