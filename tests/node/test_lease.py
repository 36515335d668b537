"""The agent's lease as pure state: welcomed only for its own session, renewed by answers,
expired after lease_s without one, and a new session after a restart."""

from __future__ import annotations

from elastic_ep.node.lease import Lease


def test_a_lease_runs_from_the_last_answer_of_its_own_session():
    lease = Lease(lease_s=2.0, alive_interval_s=0.5)
    assert lease.hello_due(0.0) and not lease.hello_due(0.5) and lease.hello_due(1.0)
    assert not lease.welcome("another session", 1.0) and not lease.welcomed
    assert lease.welcome(lease.session, 1.0) and not lease.hello_due(5.0)
    assert lease.alive_due(1.0) and not lease.alive_due(1.2) and lease.alive_due(1.6)
    lease.renew("another session", 2.5)  # an answer to an older session renews nothing
    assert not lease.expired(2.9) and lease.expired(3.1)
    lease.renew(lease.session, 3.0)
    assert not lease.expired(4.9) and lease.expired(5.1)


def test_a_restart_is_a_new_unwelcomed_session():
    lease = Lease(lease_s=1.0)
    lease.welcome(lease.session, 0.0)
    old = lease.session
    lease.restart()
    assert lease.session != old and not lease.welcomed and not lease.expired(100.0)
    assert lease.hello_due(100.0) and not lease.alive_due(100.0)


def test_an_agent_whose_node_heartbeats_go_says_alive_less_often_but_within_a_quarter_lease():
    lease = Lease(lease_s=5.0, alive_interval_s=0.1)
    lease.welcome(lease.session, 0.0)
    lease.node_beat_sent(0.0)
    assert lease.alive_due(0.0, beat_interval_s=0.1)
    lease.node_beat_sent(0.2)
    assert not lease.alive_due(0.2, beat_interval_s=0.1) and not lease.alive_due(0.4, beat_interval_s=0.1)
    lease.node_beat_sent(0.4)
    assert lease.alive_due(0.5, beat_interval_s=0.1)
    assert lease.alive_due(0.65, beat_interval_s=0.1)  # no beat for two intervals: every alive_interval_s again
    short = Lease(lease_s=1.0, alive_interval_s=0.1)  # a lease of 1 s is renewed every 0.25 s at most
    short.welcome(short.session, 0.0)
    short.node_beat_sent(0.0)
    assert short.alive_due(0.0, beat_interval_s=0.1)
    short.node_beat_sent(0.2)
    assert not short.alive_due(0.2, beat_interval_s=0.1)
    assert short.alive_due(0.25, beat_interval_s=0.1)
