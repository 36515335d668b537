"""The controller's sockets: it receives typed messages and sends them, and handles none.

Three ZeroMQ ROUTER sockets bound on the controller's host (see `elastic_ep.wire` for who sends
what on each): the step socket (worker main threads), the health socket (node agents, which
bring their workers' heartbeats, and with --step-results-via agent their step results) and the
plan socket (node agents of --step-plans-via agent take their node's step plans there), plus
a wake-up pipe other threads write to so a waiting control thread returns at once.

The plans go to agents on a socket of their own, not the health socket: an agent relays what
comes there as it came, without reading it (everything on it is a node's plans), a node's plans
(a prefill's tokens for 8 ranks) never queue ahead of a lease renewal or an `AbortEpoch` on the
agent's health connection, and the socket routes mandatorily: a node whose agent has no plan link
up (it runs --step-plans-via direct, it has not connected yet, or its queue is full because it
stalled) is known at the send, and that node's plans go to its ranks directly instead. Sending to a
peer that is gone on the step or health socket drops the message (no ROUTER_MANDATORY there): a
dead rank's silence is for the
fault detector to notice, never an exception here. Every frame is sealed with the cluster key,
and what arrives goes through each socket's `Inbox`: a frame without the key, not decodable or
not of that socket is dropped and counted (wire/codec.py), so no peer can stop the control loop;
at most `MAX_DRAIN` frames per socket are read per receive, so a flood cannot hold the loop
either.

A peer's silence is measured on `heard_clock`, which stops while this process could not listen:
a stall of the whole serve process (a thread holding the GIL while the OS runs others) freezes
this host's agent thread and delays every message, and must not read as the peers' silence.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from elastic_ep.wire import (
    HEALTH_TO_CONTROLLER,
    STEP_TO_CONTROLLER,
    ZMQ_HEARTBEAT_IVL_MS,
    ZMQ_HEARTBEAT_TIMEOUT_MS,
    ClusterKey,
    Inbox,
    StepPlan,
    node_step_plans,
)
from elastic_ep.wire.codec import count_dropped
from elastic_ep.wire.receive import recv_routed

from .timing import ControlTimes


@dataclass(frozen=True)
class Inbound:
    """One received message; `identity` is the sender's ZeroMQ identity (agents are answered by it)."""

    identity: bytes
    message: Any


MAX_DRAIN = 512  # frames read per socket per receive: the loop gets its turn whatever arrives
MAX_FRAME_BYTES = 64 << 20  # a peer sending a bigger frame is disconnected by ZeroMQ before it is read
LISTEN_SLACK_S = 0.1  # a receive this much later than it asked for means the process could not listen
# node plans queued for one agent: a step's plans go out only after the last step's results came
# back, so an agent this many frames behind has stalled, and its node's plans go direct from then on
PLAN_SEND_HWM = 8


@dataclass
class ListeningClock:
    """Monotonic seconds less the stretches in which the controller could not listen: a receive
    that returned more than `slack_s` after the wait it asked for, and the time since the last
    drain beyond `slack_s`. Never goes back. Times are time.monotonic() values."""

    slack_s: float = LISTEN_SLACK_S
    deaf_s: float = 0.0  # total time it could not listen, up to the last drain
    longest_s: float = 0.0  # the longest of those stretches (benchmarks reset it)
    drained_at: float = field(default_factory=time.monotonic)

    def drained(self, asked_s: float, now: float) -> None:
        """A receive that asked to wait up to `asked_s` returned at `now`."""
        late_s = max(0.0, now - self.drained_at - asked_s - self.slack_s)
        self.deaf_s += late_s
        self.longest_s = max(self.longest_s, late_s)
        self.drained_at = now

    def read(self, now: float) -> float:
        return now - self.deaf_s - max(0.0, now - self.drained_at - self.slack_s)


def plans_by_node(plans: list[tuple[int, StepPlan]], relayed: dict[int, str]) -> tuple[
        dict[str, list[tuple[int, StepPlan]]], list[tuple[int, StepPlan]]]:
    """(node -> its relayed ranks' (rank_id, plan), the (rank_id, plan) sent directly) of `plans`,
    by `relayed` (rank -> node), in the plans' order."""
    by_node: dict[str, list[tuple[int, StepPlan]]] = {}
    direct = []
    for rank_id, plan in plans:
        node = relayed.get(rank_id)
        if node is None:
            direct.append((rank_id, plan))
        else:
            by_node.setdefault(node, []).append((rank_id, plan))
    return by_node, direct


class ControlPlane:
    """Bind both sockets on `host`; `step_addr` and `health_addr` are what workers and agents
    connect to; `key`: the deployment's cluster key, which every frame in and out carries; `term`:
    the term this controller leads its group in (serve --etcd), which every frame out carries and
    agents and workers fence on (0 outside a group)."""

    def __init__(self, host: str, key: ClusterKey, term: int = 0):
        self.key = key
        self.term = term
        self.step_inbox = Inbox("step", STEP_TO_CONTROLLER, key)
        self.health_inbox = Inbox("health", HEALTH_TO_CONTROLLER, key)
        self.ctx = zmq.Context.instance()
        self.step_sock = self.ctx.socket(zmq.ROUTER)
        self.health_sock = self.ctx.socket(zmq.ROUTER)
        for s in (self.step_sock, self.health_sock):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTER_MANDATORY, 0)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            # No receive high-water mark: with ZeroMQ heartbeats on, libzmq 4.3.5 aborts the process
            # (`!_io_error`, stream_engine_base.cpp out_event) when a heartbeat fires on a connection
            # whose input stopped at a full pipe, which a peer's flood brings about, and a connection
            # stopped at its mark misses its peer's heartbeats and is closed with its frames in
            # flight. Frames queue in memory instead until the loop drains them (MAX_DRAIN per
            # receive, dropped cheaply): ~18 KB of heap each (libzmq's zero-copy receive buffer, kept
            # whole by a small frame read alone; benchmarks/zmq_queue_cost.py), so the memory is the
            # loop's lateness, ~23 MB a second at 1,024 stand-in ranks.
            s.setsockopt(zmq.RCVHWM, 0)
            # drop a connection whose peer went silent (a cut link) so its reconnection is clean
            s.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
            # a peer that reconnects under its identity (a worker or agent whose old connection is
            # not closed yet: a cut link, a ZeroMQ heartbeat still counting) takes its name over;
            # without it the ROUTER keeps routing to the old, dead connection
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.step_addr = f"tcp://{host}:{self.step_sock.bind_to_random_port(f'tcp://{host}')}"
        self.health_addr = f"tcp://{host}:{self.health_sock.bind_to_random_port(f'tcp://{host}')}"
        # send only; mandatory routing: a node plan to an agent with no link up raises, and goes direct
        self.plan_sock = self.ctx.socket(zmq.ROUTER)
        self.plan_sock.setsockopt(zmq.LINGER, 0)
        self.plan_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.plan_sock.setsockopt(zmq.MAXMSGSIZE, 4096)  # nothing is read there: a peer sending much is cut off
        self.plan_sock.setsockopt(zmq.RCVHWM, 0)  # as above: what arrives is drained (and dropped), never stops
        self.plan_sock.setsockopt(zmq.SNDHWM, PLAN_SEND_HWM)
        self.plan_sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        self.plan_sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        self.plan_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.plan_addr = f"tcp://{host}:{self.plan_sock.bind_to_random_port(f'tcp://{host}')}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.poller = zmq.Poller()
        for s in (self.step_sock, self.health_sock, self.plan_sock, self._wake_r):
            self.poller.register(s, zmq.POLLIN)
        self.listening = ListeningClock()
        self.times = ControlTimes()

    def heard_clock(self) -> float:
        """Now, on the clock that peers' silence is measured on (see the module's docstring)."""
        return self.listening.read(time.monotonic())

    def wake(self) -> None:
        """Make a waiting `receive` return now (any thread)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def receive(self, timeout_s: float) -> list[Inbound]:
        """Wait up to timeout_s for input (or a wake-up); everything that arrived, health socket first."""
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        self.listening.drained(timeout_s, time.monotonic())
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        out: list[Inbound] = []
        self._drain(self.health_sock, self.health_inbox, "health", out)
        self._drain(self.step_sock, self.step_inbox, "step", out)
        self._discard_plan_socket()
        return out

    def _discard_plan_socket(self) -> None:
        """Whatever a peer sent on the plan socket, which takes nothing: dropped and counted."""
        for _ in range(MAX_DRAIN):
            try:
                _, parts = recv_routed(self.plan_sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            count_dropped("plan", "", "unexpected", parts, "the plan socket is send only")

    def _drain(self, sock: zmq.Socket, inbox: Inbox, name: str, out: list[Inbound]) -> None:
        """Up to MAX_DRAIN messages of `sock` into `out`, timed and counted as the socket `name`."""
        times = self.times
        frames = nbytes = 0
        t0 = time.perf_counter()
        for _ in range(MAX_DRAIN):
            try:  # no poll per frame: a receive that finds nothing is the end of the drain
                identity, parts = recv_routed(sock, zmq.NOBLOCK)
            except zmq.Again:
                break
            frames += 1
            nbytes += sum(map(len, parts))
            message = inbox.read(parts)
            if message is not None:
                out.append(Inbound(identity, message))
        if frames:
            times.frames_in[name] += frames
            times.bytes_in[name] += nbytes
            times.decode_s[name] += time.perf_counter() - t0

    def to_worker(self, rank_id: int, message) -> None:
        """To a worker's main thread (step socket)."""
        self.step_sock.send_multipart([f"w{rank_id}".encode(), *self.key.seal(message, self.term)])

    def plans_to_workers(self, plans: list[tuple[int, StepPlan]], relayed: dict[int, str] | None = None,
                         sealed: list[tuple[str, bytes, list[bytes]]] | None = None) -> None:
        """A step's (rank_id, plan) to each worker, timed as a step's encode and send. `relayed`:
        rank -> its node, for the ranks whose plan goes in their node's `NodeStepPlans` through the
        node's agent (--step-plans-via agent; `seal_for_agents`, `send_to_agents`); the others, and
        the ranks of a node whose agent has no plan link up, directly (`messages_to_workers`).
        `sealed`: those nodes' frames, sealed already (`seal_for_agents` of these plans split by
        these `relayed`: a step prepared while the one before ran)."""
        direct = plans
        encode_s = send_s = 0.0
        nbytes = 0
        if relayed:
            by_node, direct = plans_by_node(plans, relayed)
            if sealed is None:
                t0 = time.perf_counter()
                sealed = self.seal_for_agents(by_node)
                encode_s = time.perf_counter() - t0
            send_s, nbytes, unrelayed = self.send_to_agents(sealed)
            direct.extend(p for node in unrelayed for p in by_node[node])
        e, s, n = self.messages_to_workers(direct)
        times = self.times
        times.add("encode", encode_s + e)
        times.add("send", send_s + s)
        times.bytes_out += nbytes + n
        times.plans_out["direct"] += len(direct)
        times.plans_out["relayed"] += len(plans) - len(direct)

    def seal_for_agents(self, by_node: dict[str, list[tuple[int, StepPlan]]]) -> list[tuple[str, bytes, list[bytes]]]:
        """(node, identity, frames) of each node's (rank_id, plan) of one step as one `NodeStepPlans`,
        encoded and sealed once with the current term, to send with `send_to_agents`."""
        encoded: dict = {}  # a plan shared by the nodes (the empty plan) encoded once
        return [(node, f"p{node}".encode(), self.key.seal(node_step_plans(node, plans, encoded), self.term))
                for node, plans in by_node.items()]

    def send_to_agents(self, sealed: list[tuple[str, bytes, list[bytes]]]) -> tuple[float, int, list[str]]:
        """Each node's frames (`seal_for_agents`) to its agent on the plan socket. Returns (send s,
        bytes sent, the nodes whose agent has no plan link up or a full queue: nothing of theirs
        was sent)."""
        t0 = time.perf_counter()
        send = self.plan_sock.send
        unrelayed, nbytes = [], 0
        for node, identity, (mac, body) in sealed:
            try:  # the identity part is the one that fails: no part of the message goes out
                send(identity, zmq.SNDMORE | zmq.NOBLOCK)
            except zmq.ZMQError:  # EHOSTUNREACH: no such peer; EAGAIN: its queue is full
                unrelayed.append(node)
                continue
            send(mac, zmq.SNDMORE)
            send(body)
            nbytes += len(mac) + len(body)
        return time.perf_counter() - t0, nbytes, unrelayed

    def messages_to_workers(self, messages: list[tuple[int, object]]) -> tuple[float, float, int]:
        """(rank_id, message) to each worker's main thread; the same message object given for
        several ranks (an empty plan, the `EpochStart` of every member with nothing to fill or
        send) is encoded and sealed once. Returns (encode s, send s, bytes sent)."""
        t0 = time.perf_counter()
        frames = self.seal_for_workers(messages)
        t1 = time.perf_counter()
        return t1 - t0, *self.send_sealed(frames)

    def seal_for_workers(self, messages: list[tuple[int, object]]) -> list[tuple[bytes, list[bytes]]]:
        """(identity, frames) of each (rank_id, message), sealed with the current term, to send with
        `send_sealed` (now, or once the step before completed: serve --async-scheduling)."""
        sealed: dict[int, list[bytes]] = {}  # id(message) -> its frames: a message shared by many ranks is sealed once
        frames = []
        for rank_id, message in messages:
            parts = sealed.get(id(message))
            if parts is None:
                parts = sealed[id(message)] = self.key.seal(message, self.term)
            frames.append((f"w{rank_id}".encode(), parts))
        return frames

    def send_sealed(self, frames: list[tuple[bytes, list[bytes]]]) -> tuple[float, int]:
        """Send what `seal_for_workers` sealed; returns the seconds it took and the bytes sent."""
        t0 = time.perf_counter()
        send = self.step_sock.send
        for identity, (mac, body) in frames:
            send(identity, zmq.SNDMORE)
            send(mac, zmq.SNDMORE)
            send(body)
        return time.perf_counter() - t0, sum(len(mac) + len(body) for _, (mac, body) in frames)

    def to_identity(self, identity: bytes, message) -> None:
        """To a peer of the health socket (an agent) by its identity."""
        self.health_sock.send_multipart([identity, *self.key.seal(message, self.term)])
