"""The controller's send of a step's plans over real ZeroMQ sockets (--step-plans-via agent): the
ranks of a node whose agent has its plan link up get their plans in one `NodeStepPlans`, sealed
once in the controller's term, the empty plan carried once; a node whose agent is not connected
gets its ranks' plans directly, as does a rank not relayed at all."""

from __future__ import annotations

import time

import zmq

from elastic_ep.control.control_plane import ControlPlane
from elastic_ep.wire import (
    CONTROLLER_TO_WORKER,
    RELAYED_TO_WORKER,
    ClusterKey,
    Inbox,
    NodeStepPlans,
    StepPlan,
    TermFence,
    rejected_counts,
)


def _dealer(identity: bytes, addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _read(sock: zmq.Socket, inbox: Inbox, timeout_s: float = 5.0):
    assert sock.poll(int(timeout_s * 1000)), "nothing arrived"
    return inbox.read(sock.recv_multipart())


def test_a_connected_nodes_plans_go_in_one_frame_the_others_direct():
    key = ClusterKey.generate()
    plane = ControlPlane("127.0.0.1", key, term=5)
    agent = _dealer(b"pn0", plane.plan_addr)  # node n0's agent; n1 has none connected
    ranks = {r: _dealer(f"w{r}".encode(), plane.step_addr) for r in range(5)}
    try:
        deadline = time.monotonic() + 5
        while True:  # the agent's connection is up once a plan to it is not refused
            _, _, unrelayed = plane.send_to_agents(plane.seal_for_agents({"n0": [(0, StepPlan(0, 0, [], []))]}))
            if not unrelayed:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        agent.recv_multipart()
        for sock in ranks.values():  # each rank's connection is up once the step socket hears it
            sock.send(b"up")
        heard = set()
        while len(heard) < len(ranks):
            assert plane.step_sock.poll(5000), f"ranks heard: {sorted(heard)}"
            heard.add(plane.step_sock.recv_multipart()[0])
        empty, busy = StepPlan(2, 9, [], []), StepPlan(2, 9, [], [4])
        plans = [(0, empty), (1, busy), (2, empty), (3, empty), (4, empty)]
        plane.plans_to_workers(plans, {0: "n0", 1: "n0", 2: "n0", 3: "n1"})  # rank 4: no agent known
        frame = _read(agent, Inbox("worker_plans", RELAYED_TO_WORKER, key, "n0", TermFence()))
        assert isinstance(frame, NodeStepPlans) and (frame.node, frame.epoch, frame.step) == ("n0", 2, 9)
        assert sorted(p.rank_ids for p in frame.plans) == [[0, 2], [1]]
        step_inbox = Inbox("worker_step", CONTROLLER_TO_WORKER, key, "n1")
        assert _read(ranks[3], step_inbox) == empty and _read(ranks[4], step_inbox) == empty
        assert step_inbox.term == 5
        for r in (0, 1, 2):  # a relayed rank got nothing directly
            assert not ranks[r].poll(100)
        assert plane.times.plans_out == {"direct": 2, "relayed": 3}
    finally:
        for sock in (agent, *ranks.values()):
            sock.close()
        for sock in (plane.step_sock, plane.health_sock, plane.plan_sock):
            sock.close()


def test_what_a_peer_sends_on_the_plan_socket_is_dropped_and_counted():
    key = ClusterKey.generate()
    plane = ControlPlane("127.0.0.1", key)
    peer = _dealer(b"pn0", plane.plan_addr)
    try:
        before = rejected_counts().get(("plan", "", "unexpected"), 0)
        peer.send_multipart(key.seal(StepPlan(0, 0, [], [])))
        deadline = time.monotonic() + 5
        while rejected_counts().get(("plan", "", "unexpected"), 0) == before and time.monotonic() < deadline:
            assert plane.receive(0.05) == []
        assert rejected_counts().get(("plan", "", "unexpected"), 0) == before + 1
    finally:
        peer.close()
        for sock in (plane.step_sock, plane.health_sock, plane.plan_sock):
            sock.close()
