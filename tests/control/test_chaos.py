"""Fault injection (control/chaos.py) as the step loop's hook: a step gets a `ChaosStep` only on a
rank that has something injected, with the delay, the rank's failure and the poisoned sequences
of that rank's chunks; a lost answer is one step's only; a rank fenced and started again comes
back clean."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from control_standins import Plane, cluster_of

from elastic_ep.control.chaos import ChaosInjector
from elastic_ep.control.facade.to_loop import LoseMessage, Lost, PoisonRank, PoisonRequest, SignalRank, SlowRank
from elastic_ep.control.serving.scheduler import StepBatch
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.wire import ChaosStep, ChunkPlan


def chunk(seq_id: int) -> ChunkPlan:
    return ChunkPlan(seq_id, [1], 0, True, SamplingParams(), 0, 1)


class Agents:
    def __init__(self):
        self.signals = []

    def send(self, node, message):
        pass

    def signal(self, rank_id, sig):
        self.signals.append((rank_id, sig))


def rig():
    cluster = cluster_of({0: "n0", 1: "n0", 2: "n0"})
    plane, agents, hooks = Plane(), Agents(), []
    sequences = {10: SimpleNamespace(request=SimpleNamespace(request_id="bad-1")),
                 11: SimpleNamespace(request=SimpleNamespace(request_id="good-1"))}
    return cluster, plane, agents, hooks, ChaosInjector(cluster, plane, agents, hooks.append, sequences)


def test_only_ranks_with_something_injected_get_a_chaos_step():
    cluster, plane, _, _, chaos = rig()
    batch = StepBatch({0: [chunk(10)], 1: [chunk(11)], 2: []}, {})
    chaos.before_step(0, 1, batch, [0, 1, 2])
    assert plane.sent(ChaosStep) == []
    chaos.run(SlowRank(1, 0.5))
    chaos.run(PoisonRank(2, "local"))
    chaos.run(PoisonRequest("bad", "experts"))
    chaos.before_step(0, 2, batch, [0, 1, 2])
    assert {r: m for r, m in plane.to_workers} == {0: ChaosStep(0, 2, poisoned={10: "experts"}),
                                                   1: ChaosStep(0, 2, delay_s=0.5),
                                                   2: ChaosStep(0, 2, fail_at="local")}
    assert chaos.slow_delays() == {1: 0.5}


def test_a_lost_answer_or_plan_is_of_the_next_step_only():
    _, plane, _, _, chaos = rig()
    chaos.run(LoseMessage(2, Lost.RESULT))
    chaos.run(LoseMessage(1, Lost.PLAN))
    injected = [chaos.before_step(0, step, StepBatch({}, {}), [0, 1, 2]) for step in (1, 2)]
    assert sorted(plane.to_workers) == [(1, ChaosStep(0, 1, lose_plan=True)), (2, ChaosStep(0, 1, lose_result=True))]
    assert injected == [{1, 2}, set()]  # the ranks whose plan must go directly, after their ChaosStep


def test_a_rank_started_again_comes_back_clean():
    cluster, plane, _, _, chaos = rig()
    chaos.run(SlowRank(1, 0.5))
    cluster.ranks[1].pid = 4242  # fenced and restarted
    chaos.before_step(1, 1, StepBatch({}, {}), [0, 1, 2])
    assert plane.sent(ChaosStep) == [] and chaos.slow_delays() == {}


def test_a_signal_armed_for_the_next_epoch_waits_for_it():
    cluster, _, agents, hooks, chaos = rig()
    chaos.run(SignalRank(1, signal.SIGKILL, at_next_epoch=True))
    assert agents.signals == [] and len(hooks) == 1
    hooks.pop()()
    assert agents.signals == [(1, signal.SIGKILL)]
