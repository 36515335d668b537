"""Detection rules: lost heartbeats, the progress watchdog that names a hung rank but not a slow one,
the lost step answers asked for again, and the liveness an operator sees before any deadline acts."""

from __future__ import annotations

from elastic_ep.control.faults.health_rules import (
    adaptive_deadline_s,
    hung_ranks,
    lost_heartbeats,
    rank_liveness,
    relative_speeds,
    resends_unanswered,
    results_to_ask,
    stall_reason,
)
from elastic_ep.control.ranks import Liveness
from elastic_ep.wire import Progress


def at(seq: int, epoch: int = 3, phase: str = "dispatch") -> Progress:
    return Progress(epoch=epoch, step=10, layer=1, phase=phase, seq=seq)


def test_deadline_is_a_multiple_of_recent_steps_with_a_floor():
    assert adaptive_deadline_s([], 10, 1.0) == 1.0
    assert adaptive_deadline_s([0.01, 0.02, 0.03], 10, 1.0) == 1.0
    assert adaptive_deadline_s([0.2, 0.3, 0.4], 10, 1.0) == 3.0


def test_silent_rank_is_lost():
    assert lost_heartbeats({0: 10.0, 1: 8.5, 2: 9.9}, now=10.0, timeout_s=1.0) == [1]


def test_a_rank_filling_its_slots_is_judged_by_the_load_deadline():
    seen = {0: 10.0, 1: 5.0, 2: 5.0}
    assert lost_heartbeats(seen, now=12.0, timeout_s=1.0, loading={1, 2}, load_timeout_s=30.0) == [0]
    assert lost_heartbeats(seen, now=36.0, timeout_s=1.0, loading={1}, load_timeout_s=30.0) == [0, 1, 2]


def test_the_detector_spares_a_rank_whose_last_heartbeat_said_it_loads():
    from control_standins import cluster_of, config

    from elastic_ep.control.faults.detector import FaultDetector

    c = cluster_of({0: "n0", 1: "n0"})
    for r in c.ranks.values():
        r.last_heartbeat = 100.0
    c.ranks[1].progress = Progress(epoch=0, phase="transfer")
    detector = FaultDetector(config(heartbeat_timeout_s=1.0, load_heartbeat_timeout_s=20.0))
    assert [f.rank_id for f in detector.check(105.0, c.ranks, c.members, False, 0)] == [0]
    late = detector.check(125.0, c.ranks, c.members, False, 0)
    assert [f.rank_id for f in late] == [0, 1] and "--load-heartbeat-timeout-s" in late[1].detail


def test_rank_that_has_not_entered_the_collective_the_others_wait_in_is_named_after_the_deadline():
    progress = {0: at(12), 1: at(11, phase="compute"), 2: at(12), 3: at(12)}
    first_seen = {12: 100.0}
    assert hung_ranks(progress, 3, first_seen, now=100.5, deadline_s=1.0) == []
    assert hung_ranks(progress, 3, first_seen, now=101.5, deadline_s=1.0) == [1]


def test_a_rank_still_waiting_inside_the_previous_collective_is_its_victim_not_hung():
    # rank 2 died or was cut off mid-collective 11: rank 0 got its part and moved on to 12, rank 1
    # still waits for it in 11; the silent rank is for the heartbeats to name
    progress = {0: at(12), 1: at(11, phase="combine"), 2: at(11, phase="compute")}
    assert hung_ranks(progress, 3, {12: 100.0}, now=102.0, deadline_s=1.0) == [2]


def test_a_rank_heard_idle_between_steps_waits_for_its_lost_plan_and_is_not_hung():
    # rank 1's plan was lost on the way (a cut link, a stalled agent): it heartbeats "idle" and the
    # result deadline asks it for the step; once silent past half the deadline it is named again
    progress = {0: at(12), 1: at(10, phase="idle"), 2: at(10, phase="compute")}
    heard = {0: 101.9, 1: 101.8, 2: 101.9}
    assert hung_ranks(progress, 3, {12: 100.0}, now=102.0, deadline_s=1.0, heard=heard) == [2]
    assert hung_ranks(progress, 3, {12: 100.0}, now=102.0, deadline_s=1.0, heard={**heard, 1: 101.4}) == [1, 2]
    assert hung_ranks(progress, 3, {12: 100.0}, now=102.0, deadline_s=1.0) == [1, 2]  # none heard


def test_rank_still_in_an_older_epoch_counts_as_behind():
    progress = {0: at(4), 1: at(9, epoch=2, phase="compute")}
    assert hung_ranks(progress, 3, {4: 0.0}, now=5.0, deadline_s=1.0) == [1]


def test_ranks_in_step_are_not_hung():
    progress = {0: at(12), 1: at(12)}
    assert hung_ranks(progress, 3, {12: 0.0}, now=50.0, deadline_s=1.0) == []


def test_relative_speeds_from_own_time_slow_rank_gets_less():
    speeds = relative_speeds({0: [0.01, 0.01], 1: [0.01], 2: [0.02, 0.02, 0.02], 3: []})
    assert speeds[0] == speeds[1] == 1.0 and speeds[2] == 0.5 and 3 not in speeds
    assert relative_speeds({}) == {}


def test_liveness_late_heartbeat_is_suspect_then_stalled_at_the_stall_deadline():
    def state(heartbeat_age_s: float) -> Liveness:
        return rank_liveness(heartbeat_age_s, None, False, "idle", suspect_after_s=0.5, stall_after_s=2.0).state

    assert [state(a) for a in (0.1, 0.6, 2.5)] == [Liveness.LIVE, Liveness.SUSPECT, Liveness.STALLED]


def test_in_a_stalled_step_the_rank_outside_the_collectives_is_stalled_the_others_wait():
    def liveness(step_age_s: float, in_step: bool, phase: str):
        return rank_liveness(0.05, step_age_s, in_step, phase, suspect_after_s=0.5, stall_after_s=2.0)

    holder, victim = liveness(3.0, True, "compute"), liveness(3.0, True, "dispatch")
    assert (holder.state, holder.stalled_s) == (Liveness.STALLED, 3.0)
    assert victim.state == Liveness.WAITING
    assert liveness(3.0, False, "idle").state == Liveness.LIVE  # it answered the step already
    assert liveness(1.0, True, "compute").state == Liveness.LIVE  # a slow step, not yet stalled
    reason = stall_reason(3.0, 2.0, {0: victim, 1: holder})
    assert reason.startswith("stalled: the step in flight has run 3.0s") and "rank 1 in compute" in reason
    assert "ranks [0] wait in a collective" in reason
    assert stall_reason(1.0, 2.0, {0: liveness(1.0, True, "dispatch")}) is None


def test_a_missing_answer_is_asked_for_only_past_the_deadline_and_never_of_a_rank_inside_the_step():
    progress = {1: Progress(3, 10, -1, "idle", 40),  # ran step 10 and is idle: its answer was lost
                2: Progress(3, 9, -1, "idle", 36),  # idle at step 9: the plan of step 10 never came
                3: Progress(3, 10, 4, "dispatch", 41),  # still inside step 10: slow or hung, not lost
                4: Progress(3, 10, 2, "compute", 40)}
    assert results_to_ask([1, 2, 3, 4], progress, 3, 10, waited_s=1.9, deadline_s=2.0) == []
    assert results_to_ask([1, 2, 3, 4, 5], progress, 3, 10, waited_s=2.1, deadline_s=2.0) == [1, 2, 5]  # 5: unheard
    assert results_to_ask([1], {1: Progress(2, 10, 4, "dispatch", 41)}, 3, 10, 2.1, 2.0) == [1]  # an older epoch's


def test_a_rank_asked_to_resend_is_named_after_the_resend_deadline_unless_its_plan_came_late():
    progress = {1: Progress(3, 10, -1, "idle", 40), 2: Progress(3, 10, 1, "combine", 41)}
    asked = {1: 100.0, 2: 100.0}
    assert resends_unanswered(asked, progress, 3, 10, now=100.9, timeout_s=1.0) == []
    assert resends_unanswered(asked, progress, 3, 10, now=101.1, timeout_s=1.0) == [1]  # 2 is running it now
