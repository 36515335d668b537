"""The term as fencing token: a real node agent obeys only the highest controller term it has
seen. A deposed leader's AgentShutdown (sealed in its lower term) is dropped and counted as
`stale_term`; the same order in the current term stops the agent; the agent's own frames carry
the highest term it saw."""

from __future__ import annotations

import threading
import time

import zmq

from elastic_ep.node.agent import NodeAgent
from elastic_ep.wire import AgentBye, AgentHello, AgentShutdown, LeaseRenew, rejected_counts
from elastic_ep.wire.codec import HMAC_BYTES

from .test_agent import ANY, KEY, StandInController


def stale(node: str) -> int:
    return rejected_counts().get(("agent", node, "stale_term"), 0)


def test_an_agent_ignores_a_deposed_leaders_orders_and_obeys_the_current_one():
    ctl = StandInController()
    agent = NodeAgent(ctl.health_addr, "nodeF", KEY)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        ctl.expect(ctl.health, AgentHello)
        ctl.health.send_multipart([ctl.agent_identity, *KEY.seal(LeaseRenew("", 5.0), 7)])  # the leader of term 7
        deadline = time.monotonic() + 10
        while agent.fence.highest != 7:
            assert time.monotonic() < deadline, "the agent never saw term 7"
            time.sleep(0.01)
        ctl.health.send_multipart([ctl.agent_identity, *KEY.seal(AgentShutdown(), 6)])  # the old leader's
        deadline = time.monotonic() + 10
        while stale("nodeF") == 0:
            assert time.monotonic() < deadline, "the stale frame was not counted"
            time.sleep(0.01)
        time.sleep(0.3)
        assert thread.is_alive()  # the old leader's shutdown changed nothing
        # its next hello carries term 7 in the frame's head
        poller = zmq.Poller()
        poller.register(ctl.health, zmq.POLLIN)
        while True:
            assert poller.poll(5000)
            _, head, body = ctl.health.recv_multipart()
            if isinstance(ANY.decode(body), AgentHello):
                assert int.from_bytes(head[HMAC_BYTES:], "big") == 7 and head == KEY.mac(body, 7)
                break
        ctl.health.send_multipart([ctl.agent_identity, *KEY.seal(AgentShutdown(), 7)])
        ctl.expect(ctl.health, AgentBye)
        thread.join(10)
        assert not thread.is_alive() and stale("nodeF") == 1
    finally:
        stop.set()
        thread.join(10)
        ctl.close()
