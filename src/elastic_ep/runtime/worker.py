"""One EP rank: `python -m elastic_ep.runtime.worker '<WorkerArgs json>'`.

Threads:
- main: registers, then runs what the controller sends on the step socket: `EpochStart`
  (form the group or keep it, fill the expert slots, checksum the ones it filled, report),
  `StepPlan` (attention on its own sequences, EP MoE with the epoch's group, sampling),
  `SweepSlots` (checksum a few slots between steps) and `CorruptSlot` (fault injection). It
  blocks inside collectives.
- heartbeat: its own ZeroMQ socket; sends `Heartbeat` with the main thread's progress every
  `heartbeat_interval_s`, so the controller sees which collective the rank waits in even
  while the main thread is blocked, and sees nothing once the process is stopped.

The process dies with its agent (PR_SET_PDEATHSIG), so a crashed server leaves no orphans.
Messages of an epoch other than the current one are dropped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import zmq

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.model import MoEForCausalLM, SeqChunk
from elastic_ep.model.sampling import SamplingParams, sample_tokens
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import (
    CorruptSlot,
    EpochFailed,
    EpochReady,
    EpochStart,
    Heartbeat,
    Shutdown,
    SlotChecksums,
    StepFailed,
    StepPlan,
    StepResult,
    SweepSlots,
    WorkerArgs,
    WorkerHello,
    decode,
    encode,
)

from .dense import load_dense
from .ep_moe import ExpertParallelMoE
from .experts import BackupUnreachable, ExpertSlots
from .group import EpochGroup, EpochSuperseded, ProgressBoard


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Worker:
    def __init__(self, args: WorkerArgs):
        self.args = args
        launch = args.launch
        self.progress = ProgressBoard()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"w{args.rank_id}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(launch.step_addr)
        self.config = MoEConfig.from_pretrained(launch.model_dir)
        self.reader = CheckpointReader(launch.model_dir, self.config)
        dense, self.dense_source, self.load_s = load_dense(
            self.reader, args.dense_path, args.dense_addr, launch.dense_fetch_timeout_s
        )
        self.model = MoEForCausalLM(self.config, dense)
        self.kv = self.model.new_kv_cache(launch.max_num_seqs, launch.max_model_len)
        self.slots: ExpertSlots | None = None
        self.group: EpochGroup | None = None
        self.moe: ExpertParallelMoE | None = None
        self.store = dist.TCPStore(launch.store_host, launch.store_port, is_master=False, wait_for_workers=False)
        if launch.backend == "nccl":
            self.device = torch.device("cuda", args.rank_id % max(torch.cuda.device_count(), 1))
        else:
            self.device = torch.device("cpu")
        self._pending: list = []
        self._stop = threading.Event()
        self.warmup_s = self._warm_up()

    def _warm_up(self, num_tokens: int = 8) -> float:
        """One forward of a dummy sequence before the rank registers, so the first real step it
        serves does not pay one-time costs (lazy kernel and allocator set-up). Experts are left
        out: they arrive with the epoch, and their all-to-all must run in step with the group.
        The dummy sequence's cache row is freed, so no later request can read it. Returns seconds."""
        t0 = time.perf_counter()
        warmup_seq = -1  # the controller numbers sequences from 0
        self.kv.allocate(warmup_seq)
        try:
            tokens = list(range(min(num_tokens, self.config.vocab_size)))
            self.model.forward([SeqChunk(warmup_seq, tokens, 0)], self.kv,
                               lambda layer, x, topk_ids, topk_weights: torch.zeros_like(x))
        finally:
            self.kv.free(warmup_seq)
        return time.perf_counter() - t0

    def send(self, message) -> None:
        self.sock.send(encode(message))

    def run(self) -> None:
        if self.args.launch.heartbeat_interval_s > 0:
            threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
        self.send(WorkerHello(self.args.rank_id, self.args.node, os.getpid(), self.args.join_mode,
                              self.dense_source, round(self.load_s, 4), round(self.warmup_s, 4)))
        while True:
            msg = self._pending.pop(0) if self._pending else decode(self.sock.recv())
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, EpochStart):
                if self.group is None or msg.epoch > self.group.epoch:
                    self._start_epoch(msg)
            elif isinstance(msg, StepPlan):
                if self.group is not None and msg.epoch == self.group.epoch and self.group.alive:
                    self._step(msg)
            elif isinstance(msg, SweepSlots | CorruptSlot):
                if self.slots is not None and self.group is not None and msg.epoch == self.group.epoch:
                    self._slot_request(msg)
        self._stop.set()
        if self.group is not None:
            self.group.destroy()

    def _newer_epoch_arrived(self) -> bool:
        while self.sock.poll(0):
            msg = decode(self.sock.recv())
            if isinstance(msg, (EpochStart, Shutdown)):
                self._pending = [msg]
                return True
        return False

    def _start_epoch(self, msg: EpochStart) -> None:
        args = self.args
        kept = self.group if msg.reuse_group and self.group is not None and self.group.alive \
            and self.group.members == msg.members else None
        if self.group is not None and kept is None:
            self.group.destroy()  # closes its sockets: peers that kept theirs fail fast, not at a timeout
        if msg.reuse_group and kept is None:
            self.send(EpochFailed(msg.epoch, args.rank_id, "asked to keep the epoch's group, which this rank "
                                  "no longer has"))
            return
        self.progress.new_epoch(msg.epoch)
        group = kept or EpochGroup(msg.epoch, msg.members, args.rank_id, args.launch.backend, self.device)
        try:
            if kept is None:
                rendezvous_s = group.form(self.store, msg.collective_timeout_s, self._newer_epoch_arrived)
            else:
                group.epoch, rendezvous_s = msg.epoch, 0.0
            self.group = group
            location = ExpertLocation.from_phy2log(msg.phy2log, msg.slots_per_rank, self.config.num_experts)
            if self.slots is None:
                self.slots = ExpertSlots(
                    self.config.moe_layers, msg.slots_per_rank, self.config.moe_intermediate_size, self.config.hidden_size
                )
            self.progress.enter("transfer")
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
            )
            transfer_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            unchecked = [(src.layer, src.slot) for src in msg.sources if (src.layer, src.slot) not in filled.checked]
            checksums = {**filled.checked, **self.slots.checksums(unchecked)}
            verify_s = time.perf_counter() - t0
            self.moe = ExpertParallelMoE(
                self.slots,
                location.log2phy,
                location.logcnt,
                group,
                self.progress,
                self.config.moe_layers,
                location.num_ranks,
            )
            self.progress.idle()
            self.send(EpochReady(msg.epoch, args.rank_id, checksums, filled.source_checksums, filled.stats,
                                 rendezvous_s, transfer_s, verify_s))
        except EpochSuperseded:
            group.destroy()
        except BackupUnreachable as e:
            group.destroy()
            self.send(EpochFailed(msg.epoch, args.rank_id, f"{type(e).__name__}: {e}", e.node))
        except Exception as e:  # any failure to form: the controller decides what next
            group.destroy()
            self.send(EpochFailed(msg.epoch, args.rank_id, f"{type(e).__name__}: {e}"))

    def _step(self, plan: StepPlan) -> None:
        group, moe = self.group, self.moe
        assert group is not None and moe is not None
        start = time.perf_counter()
        self.progress.enter("compute", step=plan.step)
        try:
            for seq_id in plan.free:
                self.kv.free(seq_id)
            for c in plan.chunks:
                if c.start_pos == 0 or c.seq_id not in self.kv:
                    self.kv.allocate(c.seq_id)
            if plan.delay_s > 0:
                time.sleep(plan.delay_s)
            moe.start_step(plan.dispatch_rows)
            chunks = [SeqChunk(c.seq_id, c.token_ids, c.start_pos) for c in plan.chunks]
            logits = self.model.forward(chunks, self.kv, moe.moe_fn())
            sampled = [(i, c) for i, c in enumerate(plan.chunks) if c.sample]
            tokens: dict[int, int] = {}
            if sampled:
                rows = torch.tensor([i for i, _ in sampled], dtype=torch.int64)
                params = [SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k) for _, c in sampled]
                picked = sample_tokens(
                    logits[rows],
                    params,
                    [c.seed for _, c in sampled],
                    [c.start_pos + len(c.token_ids) for _, c in sampled],
                )
                tokens = {c.seq_id: t for (_, c), t in zip(sampled, picked, strict=True)}
        except Exception as e:
            group.destroy()
            self.progress.idle()
            detail = "" if isinstance(e, RuntimeError) else traceback.format_exc(limit=3)
            self.send(StepFailed(plan.epoch, plan.step, self.args.rank_id, f"{type(e).__name__}: {e}{detail}"))
            return
        self.progress.idle()
        c = moe.counters
        step_s = time.perf_counter() - start
        self.send(
            StepResult(
                plan.epoch,
                plan.step,
                self.args.rank_id,
                tokens,
                step_s,
                step_s - c.dispatch_wait_s - c.combine_wait_s,
                c.dispatch_wait_s,
                c.combine_wait_s,
                c.expert_load,
                c.slot_tokens,
            )
        )

    def _slot_request(self, msg: SweepSlots | CorruptSlot) -> None:
        assert self.slots is not None
        if isinstance(msg, CorruptSlot):
            self.slots.corrupt(msg.layer, msg.slot)
            return
        self.send(SlotChecksums(msg.epoch, self.args.rank_id, self.slots.checksums(msg.slots)))

    def _heartbeats(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"h{self.args.rank_id}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.args.launch.health_addr)
        pid = os.getpid()
        while not self._stop.wait(self.args.launch.heartbeat_interval_s):
            sock.send(encode(Heartbeat(self.args.rank_id, pid, self.progress.current)))
        sock.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    args = WorkerArgs.from_json(argv[0])
    Worker(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
