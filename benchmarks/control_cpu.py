"""CPU time of the control thread's per-rank work, without stand-in processes: the parts of a
step that grow with the ranks, each timed alone on this process's CPU clock (not wall time), so
that a shared machine's load moves the figures less than it moves benchmarks/control_plane.py's.

    PYTHONPATH=src .venv/bin/python benchmarks/control_cpu.py [--baseline REV]

- frames: a ControlPlane's `receive` over frames queued by a peer on loopback (heartbeats: one
  rank's before node heartbeats, a node's of 8 ranks after; and `StepResult`s with an empty
  expert load as most ranks send in a step), us per frame;
- rank heartbeats: a `Controller`'s receive and `_dispatch` (what its pump does with each
  message: the detector's update, the counter) over 64 ranks' heartbeats, us per rank heartbeat:
  one `Heartbeat` frame per rank from its heartbeat thread (the tree before node heartbeats), or
  one `NodeHeartbeat` per node of 8 ranks from its agent (a tree without that path shows n/a);
- rank step results: a `Controller`'s receive, `_dispatch` and step loop (`on_reply`) over 64
  ranks' results of 125 steps (an empty expert load), us per rank result: a `StepResult` frame from
  each rank (`--step-results-via direct`), or one `NodeStepResults` per node of 8 ranks from its
  agent (`--step-results-via agent`; a tree without it shows n/a);
- whole step: the control thread's CPU ms per step of whole steps through a `Controller`'s loop
  (plan, encode and send the plans, the pumps while the step waits with everything they do: receive,
  dispatch, the detector, the publisher; then commit and the metrics) at 256 ranks with one decoding
  sequence in all (the benchmark's `--seqs-per-rank 0`), answered at once by fake ranks and agents
  in a thread of this process on real ZeroMQ sockets (their CPU is not counted), with their node
  heartbeats 10 a second per rank: each rank's `StepResult` (direct), or a `NodeStepResults` per
  node of 8 (agent); `--step-parts direct|agent` prints instead where that step's CPU goes, by
  method (receive, dispatch, the publisher, the step loop's parts, ...);
- schedule: the scheduler's `schedule` + `commit` of a step at N ranks, one decoding sequence
  in all (the others idle: the benchmark's `--seqs-per-rank 0`), then 8 and 64 decoding on every
  one of 256 ranks with short and 1,024-token prompts (each its own: no prefix hits), ms per step;
- prepared (serve --async-scheduling): at 256 ranks x 8 and x 64 decoding sequences (short
  prompts), what the scheduler does at the step boundary, between the last result and the next
  plan: `schedule` without the flag, `take_prepared` with it (the step `prepare_decodes` planned
  while the one before ran, also shown), ms per step (a tree without them shows n/a).
  `--prepared` measures only these rows;
- plans: at 256 ranks x 64 decoding sequences of 1,024-token prompts, the step's `StepPlan`s built
  and sealed by the control thread (ms per step), read by the workers (MAC and decode, ms per
  step summed over the 256: each worker pays 1/256 of it), and their bytes per rank;
- plans sent: a `ControlPlane`'s `plans_to_workers` of a step at 256 ranks (idle but one decoding
  sequence in all, so 255 share the empty plan; and x 64 decoding, 1,024-token prompts), on the
  control thread's own CPU clock: every plan sealed and sent to its rank (`--step-plans-via
  direct`), or one `NodeStepPlans` per node of 8 ranks sealed once and sent to its agent's plan
  link (`--step-plans-via agent`; a tree without it shows n/a), ms per step; and what the ranks
  then read (MAC and decode, ms per step summed over the 256: relayed, each rank reads its
  node's whole frame);
- detector: one heartbeat and watchdog check over N ranks (50 a second while a step runs), ms;
- completion: at 256 ranks x 64 decoding sequences (short prompts), what the step loop does with a
  step's tokens once every rank answered: the answers of 32 nodes' `NodeStepResults` gathered
  (`StepAnswers`, as --step-results-via agent brings them: `answers`), the scheduler's `commit`
  (of each rank's answer, or of one dict in a tree before serving/sampled.py), then `deliver_step` into the
  `StreamOutputs` frames of 2 API servers (`serve --api-server-count 2`: the frames encoded as
  their send does), ms per step: rows as tuples (a tree without columns, or a step loop that asks
  for none), and a steady rank's rows as columns where the tree has them (`commit`'s `columns`); then
  the same with requests of lengths spread over 1-199 tokens, each one that ends replaced by a new
  one (~100 end and arrive a step), `schedule` too (each arrival placed); and with each step the one
  `prepare_decodes` planned while the one before ran (`--async-scheduling`), its CPU shown as
  `prepare`. `--completion` measures
  only these rows;
- deliver: one step's tokens handed from the control thread to the HTTP side's event loop (one
  loop, as serve's uvicorn runs; each stream awaited by a task of its own, as each request's
  handler awaits it) at 256 ranks x 8 and x 64 sequences, the `RequestOutput`s built as the step
  loop builds them: the control thread's CPU ms per step, and the loop thread's (what it spends
  putting the tokens on their queues and waking the handlers; the handlers do nothing more);
  and 16,384 `RequestOutput`s built alone against the plain tuples `deliver_step` takes.
  `--deliver` measures only these rows, `--plans` only the plan rows (with --baseline, of a tree that
  has the flag).

--gc default|tuned sets this process's garbage collector before anything is built: CPython's
defaults, or what `elastic-ep serve` sets at start-up (control/gc_policy.py). --gc-tail instead
runs schedule + commit at 256 ranks x 64 decoding sequences of 1,024-token prompts step after step
with each policy (a child process each, one after the other) and prints, side by side, the mean,
p50, p99 and max CPU ms per step and the full collections run: a full collection walks every
sequence in flight on the control thread, so it shows in the tail, not in the median.

With --baseline REV the same script runs again on the `src` of git revision REV (a child
process), and the table has both, side by side. Best of --repeat runs of each.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from elastic_ep.control.api import GenerationRequest, RequestOutput
from elastic_ep.control.config import ServeConfig
from elastic_ep.control.control_plane import ControlPlane
from elastic_ep.control.controller import Controller
from elastic_ep.control.faults.detector import FaultDetector
from elastic_ep.control.gc_policy import tune_for_serving
from elastic_ep.control.ranks import AgentInfo, RankInfo, RankStatus
from elastic_ep.control.serving.alignment import AlignRule
from elastic_ep.control.serving.scheduler import Scheduler, Sequence
from elastic_ep.control.serving.streams import RemoteStream, Stream, Streams
from elastic_ep.harness.standin import standin_model
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.wire import (
    CONTROLLER_TO_WORKER,
    AgentAlive,
    ClusterKey,
    Heartbeat,
    Inbox,
    Progress,
    StepPlan,
    StepResult,
    WorkerHello,
)
from elastic_ep.wire.codec import encode

try:  # a tree with node heartbeats (the agent gathers its ranks'); before it, a Heartbeat per rank
    from elastic_ep.wire import NodeHeartbeat, RankBeat
except ImportError:
    NodeHeartbeat = RankBeat = None
try:  # a tree with step results gathered per node (--step-results-via agent)
    from elastic_ep.wire import NodeStepResults
except ImportError:
    NodeStepResults = None
try:  # a tree with step plans relayed per node (--step-plans-via agent)
    from elastic_ep.wire import RELAYED_TO_WORKER
except ImportError:
    RELAYED_TO_WORKER = None
try:  # a tree whose step answers are in columns (the step loop's `StepAnswers`)
    from elastic_ep.control.serving.step_answers import StepAnswers
except ImportError:
    StepAnswers = None
try:  # a tree whose commit takes each rank's answer (serving/sampled.py); before, one dict of the step
    from elastic_ep.control.serving.sampled import Sampled
except ImportError:
    Sampled = None
try:  # a tree whose node results are in columns, built from the node's StepResults
    from elastic_ep.node.step_gather import node_results
except ImportError:  # before: the node's StepResults as they are
    def node_results(node: str, session: str, results: list[StepResult]):
        return NodeStepResults(node, session, results)


def best_of(repeat: int, fn) -> float:
    return min(fn() for _ in range(repeat))


def frames_us(kind: str, n: int) -> float:
    """CPU us per frame of draining `n` queued frames of `kind` through ControlPlane.receive."""
    key = ClusterKey.generate()
    plane = ControlPlane("127.0.0.1", key)
    peers = []
    for i in range(8):
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, f"{'a' if kind == 'heartbeat' else 'w'}{i}".encode())
        peer.setsockopt(zmq.SNDHWM, 0)
        peer.connect(plane.health_addr if kind == "heartbeat" else plane.step_addr)
        peers.append(peer)
    progress = Progress(epoch=2, step=17, layer=40, phase="dispatch", seq=1200, since=1e9)
    if kind == "heartbeat" and NodeHeartbeat is not None:  # the heartbeat frame is a node's, of 8 ranks
        message = NodeHeartbeat("n0", "s", [RankBeat(r, 1234 + r, progress, 0.05) for r in range(8)])
    elif kind == "heartbeat":
        message = Heartbeat(3, 1234, progress)
    else:
        message = StepResult(2, 17, 3, {}, 0.02, 0.018, 0.001, 0.001, np.zeros((0, 0), np.int32), 0, {})
    frames = key.seal(message)
    for i in range(n):
        peers[i % len(peers)].send_multipart(frames)
    time.sleep(0.5 + n / 50_000)  # every frame across loopback into the ROUTER's queue
    got, cpu0 = 0, time.process_time()
    while got < n:
        got += len(plane.receive(0.0))
    cpu = time.process_time() - cpu0
    for peer in peers:
        peer.close(0)
    plane.step_sock.close(0)
    plane.health_sock.close(0)
    return 1e6 * cpu / n


def has_heartbeat_path(per_node: int) -> bool:
    """Whether this tree's controller takes heartbeats `per_node` to a frame (1: before node heartbeats)."""
    return (per_node == 1) == (NodeHeartbeat is None)


def rank_heartbeats_us(per_node: int, ranks: int = 64, frames: int = 8_000) -> float:
    """CPU us per rank heartbeat of draining `frames` queued heartbeat frames through a Controller's
    receive and `_dispatch`: per_node 1, `Heartbeat`s straight from the ranks; 8, `NodeHeartbeat`s of
    8 ranks from their agents."""
    progress = Progress(epoch=0, step=17, layer=40, phase="dispatch", seq=1200, since=1e9)
    ctl, nodes = controller_of(ranks, per_node)
    if per_node == 1:
        messages = [(f"h{r}", Heartbeat(r, 1000 + r, progress)) for r in range(ranks)]
    else:
        messages = [(f"a{node}", NodeHeartbeat(node, "s", [RankBeat(r, 1000 + r, progress, 0.05)
                                                          for r in range(8 * i, 8 * i + 8)]))
                    for i, node in enumerate(nodes)]
    cpu = dispatched_cpu_s(ctl, ctl.plane.health_addr, messages, frames)
    assert all(r.last_heartbeat > 0 for r in ctl.cluster.ranks.values())  # every rank's heartbeats were taken
    return 1e6 * cpu / (frames * per_node)


def controller_of(ranks: int, per_node: int) -> tuple[Controller, list[str]]:
    """A Controller (not started) whose `ranks` members in epoch 0 are registered on nodes of 8 with
    their agents (session "s"), and the nodes' names."""
    # past 256 ranks, an expert per rank (the controller refuses fewer)
    cfg = ServeConfig(model_dir=str(standin_model(max(256, ranks))), model_name="standin", ep_size=ranks,
                      ranks_per_node=per_node)
    ctl = Controller(cfg, ClusterKey.generate())
    c = ctl.cluster
    nodes = [f"n{i}" for i in range(ranks // 8)]
    for node in nodes:
        c.agents[node] = AgentInfo(node, f"a{node}".encode(), "tcp://x", num_ranks=8, session="s")
    for r in range(ranks):
        node = nodes[r // 8]
        c.ranks[r] = RankInfo(r, node, pid=1000 + r, status=RankStatus.SERVING,
                              hello=WorkerHello(r, node, 1000 + r, "initial", device="cpu"))
    c.members, c.epoch = list(range(ranks)), 0
    return ctl, nodes


def dispatched_cpu_s(ctl: Controller, addr: str, messages: list[tuple[str, object]], frames: int,
                     each_frame=lambda: None) -> float:
    """This thread's CPU seconds (the control thread's work, without ZeroMQ's I/O thread's) to receive
    and `_dispatch` `frames` frames queued on loopback to `addr`, the (sender identity, message) of
    `messages` in turn; `each_frame()` runs after each one's dispatch."""
    peers = []
    for identity, _ in messages:
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, identity.encode())
        peer.setsockopt(zmq.SNDHWM, 0)
        peer.connect(addr)
        peers.append(peer)
    sealed = [ctl.plane.key.seal(message) for _, message in messages]
    for i in range(frames):
        peers[i % len(peers)].send_multipart(sealed[i % len(peers)])
    time.sleep(0.5 + frames / 50_000)
    got = cpu = 0
    while got < frames:
        cpu0 = time.thread_time()
        received = ctl.plane.receive(0.0)
        heard = ctl.plane.heard_clock()
        for inbound in received:
            ctl._dispatch(inbound, heard)
            each_frame()
        got += len(received)
        if received:  # a receive that found nothing yet (frames still crossing loopback) is not the work
            cpu += time.thread_time() - cpu0
    for peer in peers:
        peer.close(0)
    ctl.plane.step_sock.close(0)
    ctl.plane.health_sock.close(0)
    return cpu


def has_node_results_path() -> bool:
    return NodeStepResults is not None


def rank_results_us(per_node: int, ranks: int = 64, steps: int = 125) -> float:
    """CPU us per rank result of `steps` steps' results (empty expert load, as most ranks send in a
    step) through a Controller's receive, `_dispatch` and step loop: per_node 1, a `StepResult`
    frame from each rank; 8, one `NodeStepResults` of 8 ranks from each node's agent."""
    ctl, nodes = controller_of(ranks, per_node)
    results = [StepResult(0, 0, r, {}, 0.02, 0.018, 0.001, 0.001, np.zeros((0, 0), np.int32), 0, {})
               for r in range(ranks)]
    if per_node == 1:
        messages = [(f"w{r}", results[r]) for r in range(ranks)]
        addr = ctl.plane.step_addr
    else:
        messages = [(f"a{node}", node_results(node, "s", results[8 * i:8 * i + 8])) for i, node in enumerate(nodes)]
        addr = ctl.plane.health_addr
    steps_loop, completed = ctl.steps, [0]

    def each_frame() -> None:  # a step's last result: the next step's come
        if len(steps_loop.replies) == ranks:
            steps_loop.replies = {}
            if hasattr(steps_loop, "answers"):  # a tree that gathers them in columns: a new step's
                steps_loop.answers = type(steps_loop.answers)()
            completed[0] += 1
    cpu = dispatched_cpu_s(ctl, addr, messages, steps * len(messages), each_frame)
    assert completed[0] == steps  # every rank's result of every step was taken
    return 1e6 * cpu / (steps * ranks)


class FakeNodes:
    """Stand-ins of `ranks` ranks on nodes of 8 for a Controller in this process, on real ZeroMQ sockets,
    served by a thread of their own (its CPU is not the control thread's): each rank answers each
    `StepPlan` at once with a `StepResult` of an empty expert load (a token for each sampled row),
    by itself (`via` "direct") or in its node's `NodeStepResults` once the node's 8 have (`via` "agent");
    each node's agent sends a `NodeHeartbeat` every 0.1 s and an `AgentAlive` every 0.25 s."""

    def __init__(self, ctl: Controller, nodes: list[str], via: str):
        self.ctl, self.nodes, self.via = ctl, nodes, via
        self.key, self.ctx, self.stop = ctl.plane.key, zmq.Context.instance(), threading.Event()
        self.inbox = Inbox("worker_step", CONTROLLER_TO_WORKER, self.key, "n0")
        self.ranks = {}
        for r in ctl.cluster.members:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"w{r}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ctl.plane.step_addr)
            self.ranks[sock] = r
        self.agents = {}
        for node in nodes:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"a{node}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ctl.plane.health_addr)
            self.agents[node] = sock
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock, r in self.ranks.items():
            poller.register(sock, zmq.POLLIN)
            sock.send_multipart(self.key.seal(StepResult(0, -1, r, {}, 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32),
                                                         0, {})))  # of no step: taken for nothing
        held: dict[str, list[StepResult]] = {node: [] for node in self.nodes}
        beat_at = alive_at = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now - beat_at >= 0.1:
                beat_at = now
                progress = Progress(0, self.ctl.cluster.step, -1, "idle", 1, time.time())
                for i, (node, sock) in enumerate(self.agents.items()):
                    sock.send_multipart(self.key.seal(NodeHeartbeat(node, "s", [
                        RankBeat(r, 1000 + r, progress, 0.001) for r in range(8 * i, 8 * i + 8)])))
            if now - alive_at >= 0.25:
                alive_at = now
                for node, sock in self.agents.items():
                    sock.send_multipart(self.key.seal(AgentAlive(node, "s")))
            for sock, _ in poller.poll(10):
                frames = sock.recv_multipart()
                plan = self.inbox.read(frames)
                if not isinstance(plan, StepPlan):
                    continue
                r = self.ranks[sock]
                tokens = {c.seq_id: 5 for c in plan.chunks if c.sample}
                decode = getattr(plan, "decode", None)
                if decode is not None:
                    tokens.update(dict.fromkeys(decode.seq_ids, 5))
                result = StepResult(plan.epoch, plan.step, r, tokens, 0.02, 0.018, 0.001, 0.001,
                                    np.zeros((0, 0), np.int32), 0, {})
                if self.via == "direct":
                    sock.send_multipart(self.key.seal(result))
                    continue
                node = self.nodes[r // 8]
                held[node].append(result)
                if len(held[node]) == 8:
                    self.agents[node].send_multipart(self.key.seal(node_results(node, "s", held[node])))
                    held[node] = []
        for sock in [*self.ranks, *self.agents.values()]:
            sock.close(0)


def whole_step_ms(via: str, ranks: int = 256, steps: int = 100) -> float | None:
    """The control thread's CPU ms per step of whole steps through a Controller's loop (`_iterate`:
    plan, encode, send, the pumps while the step waits, receive, on_reply, commit, metrics, the
    publisher, the detector) at `ranks` ranks with one decoding sequence in all (the benchmark's
    --seqs-per-rank 0), against `FakeNodes` answering at once."""
    ctl, nodes = controller_of(ranks, 8)
    c = ctl.cluster
    ctl.cfg.agent_timeout_s = 3.0  # a loaded machine's stall of the fakes' thread is no node loss
    heard = ctl.plane.heard_clock()  # every agent and rank heard now: the fakes' first heartbeats are coming
    for agent in c.agents.values():
        agent.last_alive = heard
    for rank in c.ranks.values():
        rank.last_heartbeat = heard
    c.set_readiness(True)
    ctl.scheduler.set_ranks(c.members)
    ctl.scheduler.add(Sequence(0, GenerationRequest("r0", [5, 6, 7], SamplingParams(max_tokens=1 << 30,
                                                                                      ignore_eos=True), 0),
                               1 << 30, (0,)))
    fake = FakeNodes(ctl, nodes, via)
    fake.thread.start()
    while ctl.plane.times.frames_in["step"] < ranks:  # every rank's hello in: its connection is up (a
        ctl.pump(0.01)  # plan to a rank whose connection is not is dropped)
    for _ in range(20):
        ctl._iterate()
    step0, cpu0 = c.step, time.thread_time()
    while c.step < step0 + steps:
        ctl._iterate()
    cpu = time.thread_time() - cpu0
    fake.stop.set()
    fake.thread.join()
    ctl.plane.step_sock.close(0)
    ctl.plane.health_sock.close(0)
    return 1000 * cpu / steps


# What --step-parts times of a whole step (module, class, method), inclusive: a part's time has its callees'.
STEP_PARTS = [
    ("elastic_ep.control.controller", "Controller", "pump"),
    ("elastic_ep.control.controller", "Controller", "_dispatch"),
    ("elastic_ep.control.controller", "Controller", "publish"),
    ("elastic_ep.control.controller", "Controller", "joiners"),
    ("elastic_ep.control.control_plane", "ControlPlane", "receive"),
    ("elastic_ep.control.control_plane", "ControlPlane", "plans_to_workers"),
    ("elastic_ep.control.faults.detector", "FaultDetector", "check"),
    ("elastic_ep.control.membership.standbys", "Standbys", "upkeep"),
    ("elastic_ep.control.faults.straggler_control", "StragglerControl", "review"),
    ("elastic_ep.control.serving.step_loop", "StepLoop", "_plan"),
    ("elastic_ep.control.serving.step_loop", "StepLoop", "on_reply"),
    ("elastic_ep.control.serving.step_loop", "StepLoop", "on_node_results"),
    ("elastic_ep.control.serving.step_loop", "StepLoop", "_finish"),
    ("elastic_ep.control.serving.step_loop", "StepLoop", "_observe"),
    ("elastic_ep.control.serving.step_loop", "StepLoop", "_record_links"),
    ("elastic_ep.control.facade.publisher", "Publisher", "_set_gauges"),
    ("elastic_ep.control.facade.publisher", "Publisher", "liveness"),
    ("elastic_ep.control.cluster", "ClusterState", "snapshot"),
]


def step_parts(via: str, steps: int = 200) -> None:
    """Print the control thread's CPU ms per step in each of `STEP_PARTS` (those this tree has) over
    the steps of `whole_step_ms(via)` (its warm-up's included), each method wrapped in CPU clock reads
    (which add a little to each)."""
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    for module, cls_name, method in STEP_PARTS:
        cls = getattr(importlib.import_module(module), cls_name)
        if not hasattr(cls, method):
            continue
        name = f"{cls_name}.{method}"
        spent[name], calls[name] = 0.0, 0

        def timed(*args, _f=getattr(cls, method), _name=name, **kwargs):
            cpu0 = time.thread_time()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_name] += time.thread_time() - cpu0
                calls[_name] += 1
        setattr(cls, method, timed)
    total = whole_step_ms(via, steps=steps)
    n = max(calls["StepLoop._finish"], 1)  # every step completed, the warm-up's too
    print(f"| part, results {via} | CPU ms per step | calls per step |")
    print("|---|---|---|")
    print(f"| whole step (wrapped) | {total:.2f} | 1 |")
    for name in sorted(spent, key=spent.get, reverse=True):
        print(f"| {name} | {1000 * spent[name] / n:.3f} | {calls[name] / n:.1f} |")


def decoding_scheduler(ranks: int, seqs_per_rank: int, prompt_len: int, grow_tokens: int = 48) -> Scheduler:
    """A scheduler over `ranks` ranks, `seqs_per_rank` requests on each (one in all for 0) of
    `prompt_len`-token prompts of their own, that never finish, with KV blocks for `grow_tokens`
    more tokens each (past them the pool is full and preemptions begin)."""
    n = max(ranks * seqs_per_rank, 1)
    s = Scheduler(max_num_seqs=max(seqs_per_rank, 1), max_num_batched_tokens=1 << 20, align=AlignRule(),
                  num_blocks=max(seqs_per_rank, 1) * (prompt_len // 16 + 1 + grow_tokens // 16) + 16)  # 16-token blocks
    s.set_ranks(list(range(ranks)))
    for i in range(n):
        prompt = [2 + (i * 7919 + j) % 30_000 for j in range(prompt_len)]  # its own: no prefix hit
        request = GenerationRequest(f"r{i}", prompt,
                                    SamplingParams(max_tokens=100_000, ignore_eos=True), 0)
        s.add(Sequence(i, request, 200_000, (0,)))
    return s


def sampled_of(batch):
    """A token for every sequence of the batch that samples, its chunks' and (a tree with compact
    decode plans) its decode rows', as the tree's `commit` takes them: each rank's answer in the
    order it ran them (serving/sampled.py), or one dict."""
    if Sampled is not None:
        sampled = Sampled()
        for rank, ids in ranks_sampling(batch).items():
            sampled.add(rank, ids, [5] * len(ids))
        return sampled
    sampled = {c.seq_id: 5 for cs in batch.chunks.values() for c in cs if c.sample}
    for rows in getattr(batch, "decodes", {}).values():
        sampled.update(dict.fromkeys(rows.seq_ids, 5))
    return sampled


def ranks_sampling(batch) -> dict[int, list[int]]:
    """rank -> the seq_ids it samples a token for, in the order it runs them (chunks, then decode rows)."""
    return {r: [q for q, _, _, sample in batch.runs(r) if sample]
            for r in sorted(set(batch.chunks) | set(getattr(batch, "decodes", {})))}


def node_answers(batch, ranks_per_node: int = 8) -> list:
    """The step's answers as --step-results-via agent brings them: one `NodeStepResults` a node of
    `ranks_per_node` ranks, each rank's tokens (5) in the order it ran its rows."""
    by_node: dict[int, list[StepResult]] = {}
    for rank, ids in ranks_sampling(batch).items():
        by_node.setdefault(rank // ranks_per_node, []).append(StepResult(
            0, 0, rank, dict.fromkeys(ids, 5), 0.0, 0.0, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {}))
    return [node_results(f"node{n}", "s", results) for n, results in by_node.items()]


def plans_of(batch, step: int) -> list[tuple[int, StepPlan]]:
    """Each rank's `StepPlan` of `batch`, as the step loop builds it (with its decode rows in a tree
    that has them)."""
    decodes = getattr(batch, "decodes", None)
    return [(r, StepPlan(1, step, batch.chunks[r], batch.free.get(r, []),
                         **({"decode": decodes.get(r)} if decodes is not None else {}))) for r in batch.chunks]


def schedule_ms(ranks: int, seqs_per_rank: int = 0, prompt_len: int = 6, steps: int = 20) -> float:
    """CPU ms per step of schedule + commit at `ranks` ranks, decoding: one sequence in all
    (seqs_per_rank 0), else `seqs_per_rank` on every rank; prompts of `prompt_len` tokens."""
    s = decoding_scheduler(ranks, seqs_per_rank, prompt_len)

    def step() -> None:
        batch = s.schedule()
        s.commit(batch, sampled_of(batch))

    for _ in range(5):
        step()
    cpu0 = time.process_time()
    for _ in range(steps):
        step()
    return 1000 * (time.process_time() - cpu0) / steps


def boundary_ms(ranks: int, seqs_per_rank: int, what: str, steps: int = 20) -> float:
    """CPU ms per decode step of `what`: `schedule` (each step planned after the last committed),
    or `prepare_decodes` / `take_prepared` (each step prepared while the one before runs, taken
    once it committed)."""
    s = decoding_scheduler(ranks, seqs_per_rank, 6, grow_tokens=steps + 5 + 16)
    for _ in range(5):
        batch = s.schedule()
        s.commit(batch, sampled_of(batch))
    batch, spent = s.schedule(), 0.0
    for _ in range(steps):
        cpu0 = time.process_time()
        if what != "schedule":
            s.prepare_decodes(batch)
        cpu1 = time.process_time()
        s.commit(batch, sampled_of(batch))
        cpu2 = time.process_time()
        batch = s.schedule() if what == "schedule" else s.take_prepared()[0]
        spent += (cpu1 - cpu0) if what == "prepare_decodes" else time.process_time() - cpu2
    return 1000 * spent / steps


def prepared_rows(repeat: int) -> dict:
    has = hasattr(Scheduler, "prepare_decodes")
    return {f"step boundary: {what} ms, 256 ranks x {k} sequences, 6-token prompts":
            best_of(repeat, lambda k=k, what=what: boundary_ms(256, k, what)) if has or what == "schedule" else None
            for k in (8, 64) for what in ("schedule", "take_prepared", "prepare_decodes")}


def plans_ms(ranks: int = 256, seqs_per_rank: int = 64, prompt_len: int = 1024, steps: int = 10) -> dict:
    """CPU ms per decode step of building and sealing every rank's `StepPlan`, of reading them
    as the workers do (MAC and decode, summed over the ranks), and the plans' bytes per rank."""
    key = ClusterKey.generate()
    inbox = Inbox("worker_step", CONTROLLER_TO_WORKER, key, "n0")
    s = decoding_scheduler(ranks, seqs_per_rank, prompt_len)
    for _ in range(5):
        batch = s.schedule()
        s.commit(batch, sampled_of(batch))
    seal_s = read_s = 0.0
    nbytes = 0
    for step in range(steps):
        batch = s.schedule()
        cpu0 = time.process_time()
        sealed = [key.seal(plan) for _, plan in plans_of(batch, step)]
        cpu1 = time.process_time()
        assert all(inbox.read(frames) is not None for frames in sealed)
        cpu2 = time.process_time()
        seal_s, read_s = seal_s + cpu1 - cpu0, read_s + cpu2 - cpu1
        nbytes += sum(len(body) for _, body in sealed)
        s.commit(batch, sampled_of(batch))
    return {"sealed": 1000 * seal_s / steps, "read": 1000 * read_s / steps, "bytes": nbytes / steps / ranks}


def step_plans(batch, step: int, ranks: int) -> list[tuple[int, StepPlan]]:
    """Every rank's plan of `batch` as the step loop builds it: a rank with nothing to run gets the
    one empty plan object all such ranks share (sealed once directly, carried once per node relayed)."""
    decodes = getattr(batch, "decodes", {})
    empty = StepPlan(1, step, [], [])
    return [(r, StepPlan(1, step, batch.chunks.get(r, []), batch.free.get(r, []), decode=decodes.get(r))
             if batch.chunks.get(r) or batch.free.get(r) or decodes.get(r) is not None else empty)
            for r in range(ranks)]


def plans_sent_ms(seqs_per_rank: int, ranks: int = 256, per_node: int = 8, steps: int = 10) -> dict:
    """Control-thread CPU ms per step of `plans_to_workers` at `ranks` ranks, each plan to its rank
    ("direct") or per node of `per_node` to its agent ("relayed", None in a tree without it), to
    peers connected on loopback; and the ranks' reading of what they got, ms per step summed over
    the ranks (`direct read`, `relayed read`)."""
    key = ClusterKey.generate()
    plane = ControlPlane("127.0.0.1", key)
    relays = RELAYED_TO_WORKER is not None
    ctx = zmq.Context.instance()
    peers = {}
    for r in range(ranks):
        peers[f"w{r}"] = ctx.socket(zmq.DEALER)
        peers[f"w{r}"].setsockopt(zmq.IDENTITY, f"w{r}".encode())
        peers[f"w{r}"].connect(plane.step_addr)
    for n in range(ranks // per_node if relays else 0):
        peers[f"p{n}"] = ctx.socket(zmq.DEALER)
        peers[f"p{n}"].setsockopt(zmq.IDENTITY, f"pn{n}".encode())
        peers[f"p{n}"].connect(plane.plan_addr)
    time.sleep(1.0)  # every connection up: a relayed plan to an agent not connected would go direct
    s = decoding_scheduler(ranks, seqs_per_rank, 1024 if seqs_per_rank else 6)
    for _ in range(5):
        batch = s.schedule()
        s.commit(batch, sampled_of(batch))
    batches = []
    for step in range(steps):
        batch = s.schedule()
        batches.append(step_plans(batch, step, ranks))
        s.commit(batch, sampled_of(batch))
    inboxes = {"direct": Inbox("worker_step", CONTROLLER_TO_WORKER, key, "n0")}
    if relays:
        inboxes["relayed"] = Inbox("worker_plans", RELAYED_TO_WORKER, key, "n0")
    node_of = {r: f"n{r // per_node}" for r in range(ranks)}
    out: dict[str, float | None] = {"direct": None, "relayed": None, "direct read": None, "relayed read": None}
    for mode in inboxes:
        send_s = read_s = 0.0
        for plans in batches:
            cpu0 = time.thread_time()
            if mode == "relayed":
                plane.plans_to_workers(plans, node_of)
            else:
                plane.plans_to_workers(plans)
            send_s += time.thread_time() - cpu0
            time.sleep(0.05)  # across loopback
            for name, peer in peers.items():
                while peer.poll(0):
                    frames = peer.recv_multipart(copy=False)
                    cpu0 = time.thread_time()
                    msg = inboxes[mode].read(frames)
                    assert msg is not None
                    if name.startswith("p"):  # each of the node's ranks reads the frame and its own plan: 1 here
                        msg.plan_of(int(name[1:]) * per_node)
                    read_s += (time.thread_time() - cpu0) * (per_node if name.startswith("p") else 1)
        out[mode], out[f"{mode} read"] = 1000 * send_s / steps, 1000 * read_s / steps
    if relays:  # every agent was connected: no relayed plan fell back to direct
        assert plane.times.plans_out["relayed"] == steps * ranks, plane.times.plans_out
    for peer in peers.values():
        peer.close(0)
    for sock in (plane.step_sock, plane.health_sock, getattr(plane, "plan_sock", None)):
        if sock is not None:
            sock.close(0)
    return out


def step_tail_ms(steps: int, ranks: int = 256, seqs_per_rank: int = 64, prompt_len: int = 1024) -> dict:
    """CPU ms per step of schedule + commit (mean, p50, p99, max over `steps` decode steps after 5 of
    warm-up, every one a decode: the pool holds them all) and the full (generation 2) collections
    run during them."""
    s = decoding_scheduler(ranks, seqs_per_rank, prompt_len, grow_tokens=steps + 5 + 16)
    for _ in range(5):
        batch = s.schedule()
        s.commit(batch, sampled_of(batch))
    full0, times = gc.get_stats()[2]["collections"], []
    for _ in range(steps):
        cpu0 = time.process_time()
        batch = s.schedule()
        s.commit(batch, sampled_of(batch))
        times.append(1000 * (time.process_time() - cpu0))
        assert not batch.preempted, "the pool filled: the steps are no longer all decodes"
    p50, p99 = np.percentile(times, [50, 99])
    return {"mean ms": float(np.mean(times)), "p50 ms": p50, "p99 ms": p99, "max ms": max(times),
            "full collections": gc.get_stats()[2]["collections"] - full0}


def detector_ms(ranks: int, checks: int = 50) -> float:
    """CPU ms of one detector check (heartbeats and watchdog) over `ranks` serving ranks."""
    cfg = ServeConfig(model_dir="unused", model_name="unused", ep_size=ranks)
    infos = {r: RankInfo(r, f"n{r // 8}", pid=1000 + r, status=RankStatus.SERVING,
                         hello=WorkerHello(r, f"n{r // 8}", 1000 + r, "initial", device="cpu")) for r in range(ranks)}
    for info in infos.values():
        info.last_heartbeat = 100.0
    detector, members = FaultDetector(cfg), sorted(infos)
    cpu0 = time.process_time()
    for i in range(checks):
        detector._checked_at = 0.0
        detector.check(100.5 + i * 1e-3, infos, members, True, 0)
    return 1000 * (time.process_time() - cpu0) / checks


def filled_controller(ranks: int, steps: int = 256) -> Controller:
    """A Controller of `controller_of(ranks, 8)` whose every rank has `steps` steps of timings (full
    windows at 256), varied per rank and step, written as the tree keeps them (rings or deques)."""
    ctl, _ = controller_of(ranks, 8)
    c = ctl.cluster
    rng = np.random.default_rng(0)
    ids = list(range(ranks))
    values = {s: rng.uniform(0.001, 0.05, (steps, ranks)) for s in ("step_s", "wait_s", "own_s", "link_s")}
    values["slot_tokens"] = rng.integers(0, 512, (steps, ranks)).astype(float)
    timings = getattr(c, "timings", None)
    for i in range(steps):
        for series, v in values.items():
            if timings is not None:
                timings.write(series, ids, [c.ranks[r].record for r in ids], v[i])
            else:  # a tree before the rings: a deque per rank and series
                for r in ids:
                    getattr(c.ranks[r], series).append(float(v[i, r]))
    return ctl


def snapshot_ms(ranks: int, builds: int = 5) -> dict:
    """CPU ms of one publish with the /cluster snapshot due (liveness, verdicts, the snapshot, the
    gauges), and of the snapshot's build alone (`ClusterState.snapshot`), with every rank's windows full."""
    ctl = filled_controller(ranks)
    c = ctl.cluster
    c.set_readiness(True)
    heard = ctl.plane.heard_clock()
    for rank in c.ranks.values():
        rank.last_heartbeat = heard
    build = type(c).snapshot
    spent = [0.0]

    def timed(*args, **kwargs):
        cpu0 = time.thread_time()
        try:
            return build(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - cpu0
    c.snapshot = lambda *args, **kwargs: timed(c, *args, **kwargs)
    ctl.publish(0.0)  # warm: the placement view, the first liveness
    spent[0] = 0.0
    cpu0 = time.thread_time()
    for _ in range(builds):
        ctl.publish(0.0)
    cpu = time.thread_time() - cpu0
    ctl.plane.step_sock.close(0)
    ctl.plane.health_sock.close(0)
    return {"publish": 1000 * cpu / builds, "snapshot": 1000 * spent[0] / builds}


def snapshot_rows(repeat: int) -> dict:
    rows = {}
    for n in (256, 1024):
        runs = [snapshot_ms(n) for _ in range(repeat)]
        rows[f"/cluster snapshot build (ClusterState.snapshot) ms, {n} ranks, 256-step windows"] = min(
            r["snapshot"] for r in runs)
        rows[f"publish with the snapshot due (liveness, verdicts, snapshot, gauges) ms, {n} ranks"] = min(
            r["publish"] for r in runs)
    return rows


def verdict_ms(ranks: int, spread: bool, intervals: int = 5) -> float:
    """CPU ms to work out each rank's part of one closed interval under the default rule (what the
    straggler verdict pays once per interval, every window_s / 10: StragglerControl.judge and the
    publisher's judge), `ranks` ranks of 20 steps, the same tokens a step (a decode of equal loads)
    or, with `spread`, each rank its own."""
    from elastic_ep.policy.straggler_verdict import Interval, RankInterval, StragglerRule, _columns_of

    rnd = random.Random(ranks)
    rule = StragglerRule()
    made = [Interval(0.0, 0.5, {r: RankInterval(20, 0.02 * (1 + rnd.random() / 10), 20 * (r if spread else 64))
                                for r in range(ranks)}) for _ in range(intervals)]
    cpu0 = time.thread_time()
    for interval in made:
        _columns_of(interval, rule)
    return 1000 * (time.thread_time() - cpu0) / intervals


def verdict_rows(repeat: int) -> dict:
    loads = {False: "equal tokens", True: "each its own tokens"}
    return {f"straggler verdict of a closed interval ms, {n} ranks, {loads[spread]}":
            best_of(repeat, lambda n=n, spread=spread: verdict_ms(n, spread)) for n in (256, 1024) for spread in loads}


def deliver_ms(n: int, steps: int = 30) -> dict:
    """CPU ms per step of delivering one token to each of `n` streams of one event loop (its own
    thread, a task awaiting each stream's queue): the control thread's (the `RequestOutput`s built
    and handed over as the step loop does) and the loop thread's (until every task has its token)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    loop_clock = time.pthread_getcpuclockid(thread.ident)
    streams = Streams(Scheduler(max_num_seqs=1, max_num_batched_tokens=1))
    got, taken = [0], threading.Event()

    async def handler(queue: asyncio.Queue) -> None:
        while True:
            await queue.get()
            got[0] += 1
            if got[0] == n:
                got[0] = 0
                taken.set()

    async def open_streams() -> list[asyncio.Task]:
        tasks = []
        for i in range(n):
            stream = Stream(f"r{i}", loop, asyncio.Queue())
            streams.add(i, stream)
            tasks.append(loop.create_task(handler(stream.queue)))
        return tasks

    async def close_streams() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    request_ids = [f"r{i}" for i in range(n)]  # the sequences' own, as the step loop reads them
    tasks = asyncio.run_coroutine_threadsafe(open_streams(), loop).result()
    time.sleep(0.1)  # every handler awaiting its queue
    batched = getattr(streams, "deliver_step", None)  # a tree that hands a step over at once
    control_s = loop_s = 0.0
    for step in range(steps + 3):
        taken.clear()
        loop0, cpu0 = time.clock_gettime(loop_clock), time.thread_time()
        if batched is not None:  # as its step loop hands them: tuples, the loop builds the RequestOutputs
            batched((i, [5], None, None) for i in range(n))
        else:  # the tree before: a RequestOutput built and handed over per sequence
            for i, request_id in enumerate(request_ids):
                streams.deliver(i, RequestOutput(request_id, [5], False, None, logprobs=None))
        cpu1 = time.thread_time()
        assert taken.wait(30), "the loop did not take every token"
        if step >= 3:  # past the warm-up
            control_s += cpu1 - cpu0
            loop_s += time.clock_gettime(loop_clock) - loop0
    asyncio.run_coroutine_threadsafe(close_streams(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
    return {"control": 1000 * control_s / steps, "loop": 1000 * loop_s / steps}


def built_ms(n: int, what: str) -> float:
    """CPU ms of building `n` of `what` alone: the `RequestOutput`s a step loop built per sequence,
    or the plain tuples one hands to `deliver_step`."""
    request_ids = [f"r{i}" for i in range(n)]
    cpu0 = time.thread_time()
    if what == "RequestOutput":
        built = [RequestOutput(request_id, [5], False, None, logprobs=None) for request_id in request_ids]
    else:
        built = [(i, [5], None, None) for i in range(n)]
    assert len(built) == n
    return 1000 * (time.thread_time() - cpu0)


class EncodingServers:
    """API servers whose frames are encoded as `ServerSockets.send` encodes them, then dropped."""

    def send(self, server: int, outputs) -> bool:
        encode(outputs)
        return True


def completed(s: Scheduler, streams: Streams, batch, columns: bool) -> tuple[list, float, float, float]:
    """A step's answers gathered (`StepAnswers` from one `NodeStepResults` a node of 8 ranks, as the
    step loop gathers them with --step-results-via agent; a tree without `StepAnswers`: the tokens
    as its commit takes them, built untimed), `commit` of `batch` and `deliver_step` of its outputs,
    with the steady ranks' rows as columns or as tuples (a tree without columns: always tuples):
    (the outputs, answers s, commit s, deliver s) on the CPU clock."""
    messages = node_answers(batch) if StepAnswers is not None else None
    sampled = sampled_of(batch) if messages is None else None
    cpu0 = time.process_time()
    if messages is not None:
        answers = StepAnswers()
        for message in messages:
            answers.add_node(message, 0.0)
        sampled = answers.sampled
    cpu1 = time.process_time()
    cols = [] if columns else None
    outputs = s.commit(batch, sampled, None, cols) if columns else s.commit(batch, sampled)
    cpu2 = time.process_time()
    streams.deliver_step(outputs, cols) if columns else streams.deliver_step(outputs)
    return outputs, cpu1 - cpu0, cpu2 - cpu1, time.process_time() - cpu2


def has_columns() -> bool:
    return "columns" in inspect.signature(Scheduler.commit).parameters


def completion_ms(columns: bool, ranks: int = 256, seqs_per_rank: int = 64, steps: int = 20,
                  prepared: bool = False) -> dict | None:
    """CPU ms per step of a decode step's `commit` and `deliver_step` to 2 API servers' frames (module
    docstring, completion), with the steady ranks' rows as `columns` or as tuples; with `prepared`
    each step is the one `prepare_decodes` planned while the one before ran (its CPU as `prepare`),
    taken once that one committed; None for columns in a tree without them."""
    if columns and not has_columns():
        return None
    s = decoding_scheduler(ranks, seqs_per_rank, 6, grow_tokens=steps + 5 + 16)
    streams = Streams(s, servers=EncodingServers())
    for seq_id in s.by_id:
        streams.add(seq_id, RemoteStream(f"r{seq_id}", seq_id % 2, seq_id))
    spent = {"prepare": 0.0, "answers": 0.0, "commit": 0.0, "deliver": 0.0}
    taken = None
    for step in range(steps + 3):
        batch = taken[0] if taken is not None else s.schedule()
        cpu0 = time.process_time()
        if prepared:
            s.prepare_decodes(batch)
        prepare_dt = time.process_time() - cpu0
        _, answers_dt, commit_dt, deliver_dt = completed(s, streams, batch, columns)
        taken = s.take_prepared() if prepared else None
        if step >= 3:  # the first steps prefill
            for what, dt in (("prepare", prepare_dt), ("answers", answers_dt), ("commit", commit_dt),
                             ("deliver", deliver_dt)):
                spent[what] += dt
    return {what: 1000 * v / steps for what, v in spent.items()}


def arrivals_ms(columns: bool, ranks: int = 256, seqs_per_rank: int = 64, steps: int = 40) -> dict | None:
    """CPU ms per step of `schedule`, `commit` and `deliver_step` (2 API servers' frames) at `ranks` x
    `seqs_per_rank` requests whose lengths are spread over 1-199 tokens, each ended request replaced
    by a new one (about 100 end and arrive a step at 256 x 64); None for columns in a tree without them."""
    if columns and not has_columns():
        return None
    rng = random.Random(1)
    s = Scheduler(max_num_seqs=seqs_per_rank, max_num_batched_tokens=1 << 20, align=AlignRule(),
                  num_blocks=seqs_per_rank * 20)
    s.set_ranks(list(range(ranks)))
    streams = Streams(s, servers=EncodingServers())
    added = [0]

    def arrive() -> None:
        i = added[0]
        added[0] += 1
        prompt = [2 + (i * 7919 + j) % 30_000 for j in range(6)]  # its own: no prefix hit
        s.add(Sequence(i, GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 200),
                                                                            ignore_eos=True), 0), 200_000, (0,)))
        streams.add(i, RemoteStream(f"r{i}", i % 2, i))

    for _ in range(ranks * seqs_per_rank):
        arrive()
    spent = {"schedule": 0.0, "answers": 0.0, "commit": 0.0, "deliver": 0.0}
    for step in range(steps + 20):
        cpu0 = time.process_time()
        batch = s.schedule()
        schedule_dt = time.process_time() - cpu0
        outputs, answers_dt, commit_dt, deliver_dt = completed(s, streams, batch, columns)
        for _ in range(sum(out[2] is not None for out in outputs)):
            arrive()
        if step >= 20:  # past the first prefills and the first ends
            for what, dt in (("schedule", schedule_dt), ("answers", answers_dt), ("commit", commit_dt),
                             ("deliver", deliver_dt)):
                spent[what] += dt
    return {what: 1000 * v / steps for what, v in spent.items()}


def completion_rows(repeat: int) -> dict:
    rows = {}
    for columns, how in ((False, "rows as tuples"), (True, "steady rows as columns")):
        runs = [r for r in (completion_ms(columns) for _ in range(repeat)) if r is not None]
        for what in ("answers", "commit", "deliver"):
            rows[f"completion, 256 ranks x 64 decoding, {how}: {what} ms"] = min(
                (r[what] for r in runs), default=None)
    runs = [r for r in (completion_ms(True, prepared=True) for _ in range(repeat)) if r is not None]
    for what in ("prepare", "answers", "commit", "deliver"):
        rows[f"completion, 256 ranks x 64 decoding, each step prepared (--async-scheduling): {what} ms"] = min(
            (r[what] for r in runs), default=None)
    for columns, how in ((False, "rows as tuples"), (True, "steady rows as columns")):
        runs = [r for r in (arrivals_ms(columns) for _ in range(repeat)) if r is not None]
        for what in ("schedule", "answers", "commit", "deliver"):
            rows[f"arrivals, 256 ranks x 64, ~100 ending and arriving a step, {how}: {what} ms"] = min(
                (r[what] for r in runs), default=None)
    return rows


def deliver_rows(repeat: int) -> dict:
    rows = {}
    for k in (8, 64):
        runs = [deliver_ms(256 * k) for _ in range(repeat)]
        rows[f"deliver, 256 ranks x {k} streams: control thread ms"] = min(r["control"] for r in runs)
        rows[f"deliver, 256 ranks x {k} streams: event loop thread ms"] = min(r["loop"] for r in runs)
    for what in ("RequestOutput", "tuple"):
        rows[f"16,384 {what}s built alone ms"] = best_of(3 * repeat, lambda what=what: built_ms(16_384, what))
    return rows


def measure(repeat: int, deliver_only: bool = False, plans_only: bool = False, prepared_only: bool = False,
            snapshot_only: bool = False, completion_only: bool = False, verdict_only: bool = False) -> dict:
    if verdict_only:
        return verdict_rows(repeat)
    if completion_only:
        return completion_rows(repeat)
    if snapshot_only:
        return snapshot_rows(repeat)
    if deliver_only:
        return deliver_rows(repeat)
    if plans_only:
        return {**plan_rows(repeat), **plans_sent_rows(repeat)}
    if prepared_only:
        return prepared_rows(repeat)
    return {
        "heartbeat frame us": best_of(repeat, lambda: frames_us("heartbeat", 20_000)),
        "empty StepResult frame us": best_of(repeat, lambda: frames_us("step", 20_000)),
        **{f"rank heartbeat through the controller, {n} per frame, us": (
            best_of(repeat, lambda n=n: rank_heartbeats_us(n)) if has_heartbeat_path(n) else None) for n in (1, 8)},
        **{f"rank step result through the controller, {n} per frame, us": (
            best_of(repeat, lambda n=n: rank_results_us(n)) if n == 1 or has_node_results_path() else None)
           for n in (1, 8)},
        **{f"whole step through the controller's loop, 256 ranks x 0 sequences, results {via}, ms": best_of(
            repeat, lambda via=via: whole_step_ms(via)) if via == "direct" or has_node_results_path() else None
           for via in ("direct", "agent")},
        **{f"schedule + commit ms, {n} ranks": best_of(repeat, lambda n=n: schedule_ms(n)) for n in (256, 1024)},
        **{f"schedule + commit ms, 256 ranks x {k} sequences, {p}-token prompts":
           best_of(repeat, lambda k=k, p=p: schedule_ms(256, k, p)) for k, p in ((8, 6), (8, 1024), (64, 1024))},
        **prepared_rows(repeat),
        **{f"detector check ms, {n} ranks": best_of(repeat, lambda n=n: detector_ms(n)) for n in (256, 1024)},
        **snapshot_rows(repeat),
        **verdict_rows(repeat),
        **plan_rows(repeat),
        **plans_sent_rows(repeat),
        **completion_rows(repeat),
        **deliver_rows(repeat),
    }


def plans_sent_rows(repeat: int) -> dict:
    rows = {}
    for seqs, label in ((0, "256 ranks, 1 decoding"), (64, "256 ranks x 64 decoding")):
        runs = [plans_sent_ms(seqs) for _ in range(repeat)]
        for what, name in (("direct", "direct, control CPU ms"), ("relayed", "per node via agent, control CPU ms"),
                           ("direct read", "direct, read by the ranks ms (sum)"),
                           ("relayed read", "per node via agent, read by the ranks ms (sum)")):
            values = [r[what] for r in runs if r[what] is not None]
            rows[f"plans sent {name}, {label}"] = min(values) if values else None
    return rows


def plan_rows(repeat: int) -> dict:
    runs = [plans_ms() for _ in range(repeat)]
    best = (min(r["sealed"] for r in runs), min(r["read"] for r in runs), min(r["bytes"] for r in runs))
    return {f"plans {what}, 256 ranks x 64 decoding, 1,024-token prompts": value
            for what, value in zip(("built + sealed ms", "read by the workers ms (sum)", "bytes per rank"), best,
                                   strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default=None, metavar="REV", help="also measure git revision REV's src")
    parser.add_argument("--json", action="store_true", help="print this tree's figures as JSON (for --baseline)")
    parser.add_argument("--gc", choices=["default", "tuned"], default="default",
                        help="this process's garbage collector: CPython's defaults or serve's (control/gc_policy.py)")
    parser.add_argument("--gc-tail", type=int, default=0, metavar="STEPS",
                        help="instead of the table: STEPS steps of schedule + commit at 256 x 64 with each --gc, "
                             "side by side (0: the table)")
    parser.add_argument("--deliver", action="store_true", help="only the deliver rows")
    parser.add_argument("--plans", action="store_true", help="only the plan rows")
    parser.add_argument("--prepared", action="store_true", help="only the step boundary rows (--async-scheduling)")
    parser.add_argument("--completion", action="store_true",
                        help="only the completion rows (a step's commit and delivery to 2 API servers)")
    parser.add_argument("--snapshot", action="store_true",
                        help="only the /cluster snapshot rows (256 and 1,024 ranks, full timing windows)")
    parser.add_argument("--verdict", action="store_true",
                        help="only the straggler verdict rows (one closed interval at 256 and 1,024 ranks)")
    parser.add_argument("--step-parts", choices=["direct", "agent"], default=None,
                        help="instead of the table: the whole step's CPU per part (method) with these results")
    args = parser.parse_args()
    if args.step_parts:
        step_parts(args.step_parts)
        return
    if args.gc == "tuned":
        tune_for_serving()
    if args.gc_tail and args.json:
        print(json.dumps(step_tail_ms(args.gc_tail)))
        return
    if args.gc_tail:
        print_gc_tail(args.gc_tail)
        return
    after = measure(args.repeat, args.deliver, args.plans, args.prepared, args.snapshot, args.completion,
                    args.verdict)
    if args.json:
        print(json.dumps(after))
        return
    columns = {"this tree": after}
    if args.baseline:
        repo = Path(__file__).resolve().parent.parent
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(["git", "-C", str(repo), "archive", args.baseline, "src"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            env = {**os.environ, "PYTHONPATH": str(Path(tmp) / "src")}
            only = [flag for flag, on in (("--deliver", args.deliver), ("--plans", args.plans),
                                          ("--prepared", args.prepared), ("--snapshot", args.snapshot),
                                          ("--completion", args.completion), ("--verdict", args.verdict)) if on]
            done = subprocess.run([sys.executable, __file__, "--json", "--repeat", str(args.repeat), "--gc", args.gc,
                                   *only], check=True, capture_output=True, text=True, env=env)
        columns = {args.baseline: json.loads(done.stdout.strip().splitlines()[-1]), **columns}
    names = list(columns)
    print("| what | " + " | ".join(names) + (" | ratio |" if len(names) == 2 else " |"))
    print("|---|" + "---|" * (len(names) + (len(names) == 2)))
    for what in after:
        values = [columns[n].get(what) for n in names]
        ratio = f" {values[0] / values[1]:.2f}x |" if len(values) == 2 and None not in values and values[1] else \
            (" |" if len(values) == 2 else "")
        print(f"| {what} | " + " | ".join("n/a" if v is None else f"{v:.2f}" for v in values) + " |" + ratio)
    if len(names) == 2:  # the path per rank heartbeat: the tree before's single frames, this tree's node frames
        single, node = (columns[n].get(f"rank heartbeat through the controller, {k} per frame, us")
                        for n, k in zip(names, (1, 8), strict=True))
        if single and node:
            print(f"| rank heartbeat through the controller, {names[0]} (1 per frame) / this tree (8 per frame) "
                  f"| {single:.2f} | {node:.2f} | {single / node:.2f}x |")


def print_gc_tail(steps: int) -> None:
    """The step tail with each collector policy, each measured in a child process of its own."""
    columns = {}
    for policy in ("default", "tuned"):
        done = subprocess.run([sys.executable, __file__, "--json", "--gc", policy, "--gc-tail", str(steps)],
                              check=True, capture_output=True, text=True)
        columns[policy] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"| schedule + commit, 256 ranks x 64 decoding, {steps} steps | default GC | tuned GC | ratio |")
    print("|---|---|---|---|")
    for what, default in columns["default"].items():
        tuned = columns["tuned"][what]
        ratio = f"{default / tuned:.2f}x" if tuned and what != "full collections" else ""
        print(f"| {what} | {default:.1f} | {tuned:.1f} | {ratio} |" if what != "full collections"
              else f"| {what} | {default} | {tuned} | |")


if __name__ == "__main__":
    main()
