"""A stand-in agent ends its session only on the controller's `SessionEnded` for that session,
as the real agent does: the answers to an older session's alives, which arrive after it
registered again, leave the new session and its ranks alone. A stand-in's reported expert load
is the sum of its steps' templates."""

from __future__ import annotations

import numpy as np

from elastic_ep.harness.standin import LoadTemplates, StandInAgent, StandInHost, StandInTiming
from elastic_ep.wire import ClusterKey, SessionEnded


def test_an_older_sessions_end_leaves_the_new_session_alone():
    host = StandInHost(ClusterKey.generate())
    agent = StandInAgent(host, "tcp://127.0.0.1:1", "n0", 1, StandInTiming())
    try:
        old = agent.lease.session
        agent.lease.restart()
        new = agent.lease.session
        agent.on_message(agent.sock, SessionEnded(old, "the controller gave up on this session"))
        assert agent.lease.session == new
        agent.on_message(agent.sock, SessionEnded(new, "the controller gave up on this session"))
        assert agent.lease.session != new
    finally:
        agent.sock.close()
        host.epoll.close()


def test_a_stand_ins_reported_load_is_the_sum_of_its_steps_templates():
    """Kept as token counts between reports (no [L, E] array per step): the same integers as
    adding each step's template; nothing but empty steps reports the empty load."""
    loads = LoadTemplates(3, 16, 2)
    steps = [5, 0, 5, 7, 1]
    counts = {n: steps.count(n) for n in set(steps) if n}
    expected = sum(loads.load(n) for n in steps)
    assert (loads.summed(counts) == expected).all() and loads.summed(counts).dtype == np.int32
    assert loads.summed({}).shape == (0, 0)
