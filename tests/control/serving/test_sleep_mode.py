"""Sleep and wake (control/serving/sleep_mode.py) with stand-ins: a sleep is refused naming why
(a level other than 1 or 2, requests running, already asleep), goes to every member and is
answered once all of them answered; while asleep steps are blocked and the cluster is not ready;
a wake with an error leaves the group asleep for a second try."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from control_standins import Plane, cluster_of
from prometheus_client import CollectorRegistry, Gauge

from elastic_ep.control.api import ScaleRejected
from elastic_ep.control.serving.sleep_mode import SleepMode
from elastic_ep.wire import SleepRank, SleepReply, WakeRank


class Rig:
    def __init__(self):
        self.cluster = cluster_of({0: "n0", 1: "n0", 2: "n1"})
        self.cluster.set_readiness(True)
        self.plane = Plane()
        self.gauge = Gauge("sleep_state", "test", registry=CollectorRegistry())
        self.why = ""
        self.mode = SleepMode(self.cluster, self.plane, self.gauge, busy=lambda: self.why, publish=lambda: None)

    def answer(self, level: int, error: str = "", ranks=(0, 1, 2)):
        for r in ranks:
            self.mode.on_reply(SleepReply(r, level, 1000, 400 if level else 1000, 0.01, error))


def test_a_sleep_goes_to_every_member_and_is_answered_once_all_answered():
    rig = Rig()
    reply: Future = Future()
    rig.mode.sleep(2, reply)
    assert [(r, m.level) for r, m in rig.plane.to_workers if isinstance(m, SleepRank)] == [(0, 2), (1, 2), (2, 2)]
    assert rig.mode.blocks_steps and not reply.done()
    rig.answer(2, ranks=(0, 1))
    assert not reply.done()
    rig.answer(2, ranks=(2,))
    view = reply.result(0)
    assert view["is_sleeping"] and view["level"] == 2 and view["ranks"]["1"]["rss_after_bytes"] == 400
    assert not rig.cluster.readiness.ready and "POST /wake_up" in rig.cluster.readiness.reason
    assert rig.gauge._value.get() == 2
    woke: Future = Future()
    rig.mode.wake(woke)
    assert sum(isinstance(m, WakeRank) for _, m in rig.plane.to_workers) == 3
    rig.answer(0)
    assert woke.result(0)["is_sleeping"] is False and rig.cluster.readiness.ready and not rig.mode.blocks_steps
    assert rig.gauge._value.get() == 0


@pytest.mark.parametrize("level,why,status,needle", [(3, "", 400, "not a sleep level"),
                                                    (1, "requests run or wait", 409, "requests run")])
def test_a_sleep_is_refused_naming_why(level, why, status, needle):
    rig = Rig()
    rig.why = why
    with pytest.raises(ScaleRejected, match=needle) as e:
        rig.mode.sleep(level, Future())
    assert e.value.status == status and rig.plane.to_workers == [] and not rig.mode.blocks_steps


def test_asleep_twice_is_409_and_a_wake_when_awake_is_answered_at_once():
    rig = Rig()
    awake: Future = Future()
    rig.mode.wake(awake)
    assert awake.result(0)["is_sleeping"] is False and rig.plane.to_workers == []
    rig.mode.sleep(1, Future())
    rig.answer(1)
    with pytest.raises(ScaleRejected, match="already asleep at level 1") as e:
        rig.mode.sleep(2, Future())
    assert e.value.status == 409


def test_a_wake_with_an_error_stays_asleep_for_a_second_try():
    rig = Rig()
    rig.mode.sleep(2, Future())
    rig.answer(2)
    woke: Future = Future()
    rig.mode.wake(woke)
    rig.answer(2, error="OSError: checkpoint gone", ranks=(0,))
    rig.answer(0, ranks=(1, 2))
    assert woke.result(0)["is_sleeping"] and rig.mode.blocks_steps and not rig.cluster.readiness.ready
    assert rig.cluster.events.all()[-1]["message"].startswith("still asleep")


def test_a_fault_while_falling_asleep_ends_the_sleep_and_answers_409():
    rig = Rig()
    reply: Future = Future()
    rig.mode.sleep(1, reply)
    rig.answer(1, ranks=(0,))
    rig.mode.abandon("rank 1 failed (no heartbeat)")
    with pytest.raises(ScaleRejected, match="rank 1 failed") as e:
        reply.result(0)
    assert e.value.status == 409 and not rig.mode.blocks_steps and rig.gauge._value.get() == 0
