"""A stand-in agent ends its session only on the controller's `SessionEnded` for that session,
as the real agent does: the answers to an older session's alives, which arrive after it
registered again, leave the new session and its ranks alone. A stand-in's reported expert load
is the sum of its steps' templates. A plan sent ahead waits for the step before, as on a worker."""

from __future__ import annotations

import time

import numpy as np

from elastic_ep.harness.standin import LoadTemplates, StandInAgent, StandInHost, StandInRank, StandInTiming
from elastic_ep.wire import (
    SAMPLED_TOKEN,
    ClusterKey,
    DecodeRows,
    ResendResult,
    SessionEnded,
    StepErrorKind,
    StepFailed,
    StepPlan,
)


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


def test_a_plan_sent_ahead_waits_for_the_step_before_and_both_answers_can_be_sent_again():
    """serve --send-ahead-steps: a stand-in rank given its next plan while a step runs runs it once that
    step is answered, as a worker reads its socket; asked again for the first step's answer after
    answering the second, it sends the one it kept, not NOT_RUN (a step it never ran is NOT_RUN)."""
    host = StandInHost(ClusterKey.generate())
    agent = StandInAgent(host, "tcp://127.0.0.1:1", "n0", 1, StandInTiming(step_s=0.01))
    agent.loads, agent.vocab = LoadTemplates(2, 8, 1), 50
    rank = StandInRank(agent, 0, 1000, "initial")
    sent: list = []
    rank.send = sent.append  # the step socket: what the rank answers, in order
    try:
        rank.epoch = 3
        rows = DecodeRows([7], [SAMPLED_TOKEN], [4])
        rank.plan_arrived(StepPlan(3, 10, [], [], decode=DecodeRows([7], [5], [3])))
        rank.plan_arrived(StepPlan(3, 11, [], [], decode=rows))  # sent ahead: queued behind step 10
        assert rank.pending == (3, 10) and [p.step for p in rank.queued] == [11]
        deadline = time.monotonic() + 5
        while len(sent) < 2 and time.monotonic() < deadline:
            host.timers.run_due(time.monotonic())
            time.sleep(0.002)
        assert [(m.step, m.tokens) for m in sent] == [(10, {7: agent.token(7, 4)}), (11, {7: agent.token(7, 5)})]
        assert rank.pending is None and not rank.queued
        rank.on_message(None, ResendResult(3, 10))
        rank.on_message(None, ResendResult(3, 9))
        assert sent[2] is sent[0]
        assert isinstance(sent[3], StepFailed) and sent[3].kind == StepErrorKind.NOT_RUN
    finally:
        agent.sock.close()
        host.epoll.close()
