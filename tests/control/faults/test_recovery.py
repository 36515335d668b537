"""Recovery (control/faults/recovery.py) built with stand-ins: a dead member is fenced, drained,
its requests requeued and its restart due, and the next epoch is asked for as
`Recover(survivors)`; a member that never leaves the failed step, an unconfirmed fence, too few
ranks, an epoch with no placement and a failure with every rank alive each go the way the
module says."""

from __future__ import annotations

import pytest
from control_standins import cluster_of, config
from prometheus_client import CollectorRegistry

from elastic_ep.control.epochs.epoch_change import EpochReport, NoPlacement
from elastic_ep.control.epochs.requests import Recover
from elastic_ep.control.faults.detector import Fault, FaultCause, FaultDetector
from elastic_ep.control.faults.recovery import Recovery
from elastic_ep.control.metrics import ClusterMetrics
from elastic_ep.control.ranks import RankStatus


def report(epoch: int, members: list[int]) -> EpochReport:
    return EpochReport(epoch, members, 0.0, 0.0, 0.01, 0.0, {"peer": {"bytes": 64, "seconds": 0.01}}, 0.02, 2, "")


class Steps:
    """The step in flight: `stuck` ranks never answer it."""

    def __init__(self, in_step: set[int], stuck: set[int] = frozenset()):
        self.in_step, self.stuck = set(in_step), set(stuck)
        self.faults_seen: list[tuple[bool, str]] = []

    def unanswered(self, excluded):
        return [r for r in self.in_step if r in self.stuck and r not in excluded]

    def abandon(self):
        self.in_step = set()

    def after_fault(self, culprit_found, error):
        self.faults_seen.append((culprit_found, error))


class Processes:
    """Fences are confirmed at the next pump unless the rank's agent is `silent`."""

    def __init__(self, cluster, silent: set[int] = frozenset()):
        self.cluster, self.silent = cluster, set(silent)
        self.fenced, self.restarts, self.forgotten, self.aborted = [], [], [], []

    def fence(self, rank_id, reason):
        self.fenced.append(rank_id)
        self.cluster.ranks[rank_id].status = RankStatus.FENCING

    def confirm_lost(self, rank_id):
        self.cluster.ranks[rank_id].status = RankStatus.DEAD

    def forget_rank(self, rank_id, message):
        self.forgotten.append(rank_id)

    def schedule_restart(self, rank_id):
        self.restarts.append(rank_id)

    def stop_rank(self, rank_id):
        raise AssertionError("no rank leaves with a scale here")

    def abort_epoch(self, rank_ids, epoch):
        self.aborted.extend((rank_id, epoch) for rank_id in rank_ids)

    def confirm(self):
        for r in self.fenced:
            if r not in self.silent and self.cluster.ranks[r].status == RankStatus.FENCING:
                self.cluster.ranks[r].status = RankStatus.FENCED


class NoScale:
    def joiner(self, rank_id):
        return False

    def leaves(self, rank_id):
        return False

    def fail(self, error):
        raise AssertionError("no scale in flight")


class Rebalance:
    def __init__(self):
        self.calls = []

    def request(self, reason):
        self.calls.append(("request", reason))

    def cancel(self):
        self.calls.append(("cancel", None))


class Scheduler:
    def __init__(self):
        self.by_id, self.evicted = {7: object()}, []

    def evict_rank(self, rank_id):
        self.evicted.append(rank_id)


class Streams:
    def __init__(self):
        self.ended = []

    def end_with_error(self, seq_id, error):
        self.ended.append((seq_id, error))


class Rig:
    """A recovery over ranks 0-3 on two nodes (8 experts, 4 slots a rank: 2 ranks hold them all)."""

    def __init__(self, *, stuck=frozenset(), silent=frozenset(), outcome=None, **flags):
        self.cfg = config(drain_timeout_s=0.05, fence_timeout_s=0.05, **flags)
        self.cluster = cluster_of({0: "n0", 1: "n0", 2: "n1", 3: "n1"})
        self.detector = FaultDetector(self.cfg)
        self.steps = Steps(set(self.cluster.members), stuck)
        self.processes = Processes(self.cluster, silent)
        self.rebalance = Rebalance()
        self.scheduler, self.streams = Scheduler(), Streams()
        self.formed: list[tuple[object, str]] = []
        self.outcome = outcome
        self.left: list[list[int]] = []
        self.recovery = Recovery(
            self.cluster, self.cfg, self.detector, ClusterMetrics(CollectorRegistry()), self.steps, self.scheduler,
            self.streams, NoScale(), self.processes, self.rebalance, pump=lambda timeout_s: self.processes.confirm(),
            fault=self.detector.record, joiners=lambda live: [], form=self.form, leave=self.leave,
            reset_isolation=lambda: None, publish=lambda: None)

    def form(self, request, reason):
        self.formed.append((request, reason))
        if self.outcome is not None:
            return self.outcome
        self.cluster.epoch += 1
        self.cluster.members = list(request.live)
        return report(self.cluster.epoch, list(request.live))

    def leave(self, live):
        self.left.append(list(live))
        self.cluster.members = [r for r in self.cluster.members if r in live]

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.cluster.events.all()]


def test_a_dead_member_is_fenced_requeued_restarted_and_the_survivors_form_the_next_epoch():
    rig = Rig()
    rig.detector.record(Fault(1, FaultCause.EXITED, "process exited with code -9"))
    rig.recovery.run()
    assert rig.processes.aborted == [(r, 0) for r in (0, 1, 2, 3)]  # the failed epoch's collectives give up
    assert rig.processes.fenced == [1] and rig.cluster.ranks[1].status == RankStatus.FENCED
    assert rig.scheduler.evicted == [1] and rig.processes.restarts == [1]
    assert rig.formed == [(Recover([0, 2, 3], [0, 2, 3]), "recovery")]
    assert rig.rebalance.calls == [("cancel", None), ("request", "recovery")]
    assert rig.steps.in_step == set() and rig.steps.faults_seen == [(True, "rank 1: process exited with code -9")]
    assert not rig.detector.pending and rig.recovery.open

    rig.recovery.step_completed(0.01)
    recovered = rig.cluster.events.all()[-1]
    assert recovered["kind"] == "recovered" and recovered["culprits"] == [1] and recovered["epoch"] == 1
    assert not rig.recovery.open


def test_a_member_that_never_leaves_the_failed_step_is_named_too():
    rig = Rig(stuck={2})
    rig.detector.record(Fault(1, FaultCause.EXITED, "process exited with code -9"))
    rig.recovery.run()
    assert rig.processes.fenced == [1, 2]  # named after --drain-timeout-s, then fenced in the same drain
    assert rig.formed[0][0] == Recover([0, 3], [0, 3])
    assert "rank 2: no answer" in rig.cluster.events.all()[-1]["message"]


def test_a_fence_its_agent_never_confirms_counts_the_rank_as_dead():
    rig = Rig(silent={1})
    rig.detector.record(Fault(1, FaultCause.HUNG, "hung"))
    rig.recovery.run()
    assert rig.cluster.ranks[1].status == RankStatus.DEAD
    assert "fence-timeout" in rig.kinds() and rig.formed[0][0] == Recover([0, 2, 3], [0, 2, 3])


def test_too_few_live_ranks_degrade_without_asking_for_an_epoch():
    rig = Rig()
    for r in (0, 1, 2):
        rig.detector.record(Fault(r, FaultCause.EXITED, "process exited with code -9"))
    rig.recovery.run()
    assert rig.formed == [] and rig.left == [[3]] and rig.cluster.members == [3]
    assert not rig.cluster.readiness.ready and "too few ranks" in rig.cluster.readiness.reason
    assert ("request", "recovery") not in rig.rebalance.calls


def test_no_placement_over_the_survivors_degrades_with_its_reason():
    rig = Rig(outcome=NoPlacement("no placement over ranks [0, 2, 3]: test"))
    rig.detector.record(Fault(1, FaultCause.EXITED, "process exited with code -9"))
    rig.recovery.run()
    assert rig.rebalance.calls[-1] == ("cancel", None)
    assert rig.cluster.readiness.reason == "no placement over ranks [0, 2, 3]: test" and "degraded" in rig.kinds()


def test_a_failure_with_every_rank_alive_goes_back_to_the_step_loop_and_re_forms_the_group():
    rig = Rig()
    rig.detector.error("rank 2: gloo: connection closed")
    rig.recovery.run()
    assert rig.processes.fenced == [] and rig.processes.restarts == []
    assert rig.steps.faults_seen == [(False, "error without a dead rank: rank 2: gloo: connection closed")]
    assert rig.formed[0][0] == Recover([0, 1, 2, 3], [0, 1, 2, 3])


def test_an_evicted_rank_is_retired_not_restarted():
    rig = Rig()
    rig.detector.record(Fault(2, FaultCause.EVICTED, "slow"))
    rig.recovery.run()
    assert rig.processes.forgotten == [2] and rig.processes.restarts == []


@pytest.mark.parametrize("degraded_for_s, ended", [(0.0, []), (100.0, [7])])
def test_streams_end_only_after_the_degraded_timeout(degraded_for_s, ended):
    import time

    rig = Rig(degraded_timeout_s=10.0)
    rig.cluster.set_readiness(False, "too few ranks")
    rig.cluster.degraded_since = time.monotonic() - degraded_for_s
    rig.recovery.end_requests_if_degraded_too_long()
    assert [s for s, _ in rig.streams.ended] == ended
