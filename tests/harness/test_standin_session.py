"""A stand-in agent ends its session only on the controller's `SessionEnded` for that session,
as the real agent does: the answers to an older session's alives, which arrive after it
registered again, leave the new session and its ranks alone."""

from __future__ import annotations

from elastic_ep.harness.standin import StandInAgent, StandInHost, StandInTiming
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
