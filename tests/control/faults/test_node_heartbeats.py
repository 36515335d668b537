"""The detector judging the heartbeats an agent gathers for its node (`NodeHeartbeat`): each entry
is its rank's heartbeat heard at arrival less its age, so a rank whose age grows (stopped) is lost
at the same deadline as if nothing had come for it, and a silent agent's ranks time out with it;
the watchdog counts a collective from the arrival of the first message that shows it, and keeps
the first sightings of the last SIGHTINGS_KEPT collectives only; of an agent's several messages
read in one batch, its newest dates its ranks."""

from __future__ import annotations

import pytest
from control_standins import cluster_of, config

from elastic_ep.control.faults.detector import SIGHTINGS_KEPT, FaultCause, FaultDetector, superseded_node_beats
from elastic_ep.wire import NodeHeartbeat, Progress, RankBeat

INTERVAL_S = 0.1  # the agent's forwarding interval (--heartbeat-interval-s)


def node_beat(node: str, ages: dict[int, float], progress: dict[int, Progress] | None = None) -> NodeHeartbeat:
    """The node's message: rank -> age at the agent (pid 1000 + rank, as cluster_of registers them)."""
    progress = progress or {}
    return NodeHeartbeat(node, "s", [RankBeat(r, 1000 + r, progress.get(r, Progress(epoch=0)), age)
                                     for r, age in ages.items()])


def lost(detector: FaultDetector, c, now: float) -> dict[int, FaultCause]:
    detector._checked_at = 0.0  # every call checks (the period is the control loop's business)
    return {f.rank_id: f.cause for f in detector.check(now, c.ranks, c.members, False, 0)}


def take_batch(detector: FaultDetector, c, batch: list[NodeHeartbeat], now: float) -> None:
    """One received batch, as the control loop takes it (controller.py `pump`)."""
    superseded = superseded_node_beats(batch)
    for k, msg in enumerate(batch):
        if k not in superseded:
            detector.node_heartbeat(c.ranks, msg, 0, now)


def test_a_rank_whose_age_grows_is_lost_at_its_deadline_and_its_node_mates_are_not():
    c = cluster_of({0: "n0", 1: "n0", 2: "n1"})
    detector = FaultDetector(config(heartbeat_timeout_s=1.0))
    stopped_at = 100.0  # rank 1 beat last at 100.0 (agent's hearing), then was SIGSTOPped
    now = 100.0
    while now < 101.5:  # the agents forward every interval; rank 1's entry stays, older each time
        assert detector.node_heartbeat(c.ranks, node_beat("n0", {0: 0.03, 1: round(now - stopped_at, 3)}), 0,
                                       now) == 2
        detector.node_heartbeat(c.ranks, node_beat("n1", {2: 0.05}), 0, now)
        assert c.ranks[1].last_heartbeat == stopped_at  # the same beat again moves nothing
        assert lost(detector, c, now) == ({1: FaultCause.HEARTBEAT_LOST} if now - stopped_at > 1.0 else {})
        now = round(now + INTERVAL_S, 3)
    last = now - INTERVAL_S  # the last node messages' arrival
    assert (c.ranks[0].last_heartbeat, c.ranks[2].last_heartbeat) == (pytest.approx(last - 0.03),
                                                                      pytest.approx(last - 0.05))


def test_a_silent_agent_hides_nothing_its_ranks_time_out():
    c = cluster_of({0: "n0", 1: "n0", 2: "n1"})
    detector = FaultDetector(config(heartbeat_timeout_s=1.0))
    for now in (100.0, 100.1, 100.2):
        detector.node_heartbeat(c.ranks, node_beat("n0", {0: 0.01, 1: 0.02}), 0, now)
        detector.node_heartbeat(c.ranks, node_beat("n1", {2: 0.01}), 0, now)
    # n0's agent goes silent at 100.2 (lost, stopped, cut off); n1's keeps forwarding
    for now in (100.3, 100.8, 101.1):
        detector.node_heartbeat(c.ranks, node_beat("n1", {2: 0.01}), 0, now)
        assert lost(detector, c, now) == {}
    detector.node_heartbeat(c.ranks, node_beat("n1", {2: 0.01}), 0, 101.3)
    assert lost(detector, c, 101.3) == {0: FaultCause.HEARTBEAT_LOST, 1: FaultCause.HEARTBEAT_LOST}


def test_entries_of_another_node_or_process_are_not_taken():
    c = cluster_of({0: "n0", 1: "n1"})
    detector = FaultDetector(config())
    wrong_node = node_beat("n1", {0: 0.0})  # rank 0 runs on n0
    wrong_pid = NodeHeartbeat("n0", "s", [RankBeat(0, 77, Progress(epoch=0), 0.0)])  # an old process of rank 0
    unknown = NodeHeartbeat("n0", "s", [RankBeat(9, 1009, Progress(epoch=0), 0.0)])
    for msg in (wrong_node, wrong_pid, unknown):
        assert detector.node_heartbeat(c.ranks, msg, 0, 100.0) == 0
    assert c.ranks[0].last_heartbeat == 0.0


def test_a_collective_counts_from_the_arrival_of_the_first_message_that_shows_it():
    """Only the heartbeat's own time is dated back by its age; a collective first shown in a node's
    message counts from that message's arrival (at most one forwarding interval after the agent
    heard it), so an agent that stalled and sends what it read before cannot make it look old."""
    c = cluster_of({0: "n0", 1: "n0"})
    detector = FaultDetector(config(watchdog_floor_s=1.0))
    entered = Progress(epoch=0, step=4, layer=1, phase="dispatch", seq=12)
    behind = Progress(epoch=0, step=4, layer=1, phase="compute", seq=11)
    # read by the agent 1.5 s before it could send (its process stalled)
    detector.node_heartbeat(c.ranks, node_beat("n0", {0: 1.5, 1: 1.5}, {0: entered, 1: behind}), 0, 100.0)
    assert detector.seq_first_seen[12] == 100.0 and c.ranks[0].progress_at == 100.0
    assert c.ranks[0].last_heartbeat == 98.5
    detector.node_heartbeat(c.ranks, node_beat("n0", {0: 0.01, 1: 0.01}, {0: entered, 1: behind}), 0, 100.5)
    assert detector.seq_first_seen[12] == 100.0  # the first sighting stays
    detector._checked_at = 0.0
    assert detector.check(100.9, c.ranks, c.members, True, 0) == []
    detector._checked_at = 0.0
    assert [(f.rank_id, f.cause) for f in detector.check(101.01, c.ranks, c.members, True, 0)] == \
        [(1, FaultCause.HUNG)]


def test_first_sightings_stay_bounded_over_a_long_epoch_and_the_watchdog_still_names_a_hang():
    c = cluster_of({0: "n0", 1: "n0"})
    detector = FaultDetector(config(watchdog_floor_s=1.0, heartbeat_timeout_s=10.0))
    now = 100.0
    for seq in range(1, 20_001):  # both ranks through 20,000 collectives, one sighting each
        p = Progress(epoch=0, step=seq // 116, layer=0, phase="dispatch", seq=seq)
        detector.node_heartbeat(c.ranks, node_beat("n0", {0: 0.0, 1: 0.0}, {0: p, 1: p}), 0, now)
        now = round(now + 0.001, 3)
    assert len(detector.seq_first_seen) <= SIGHTINGS_KEPT
    # rank 0 enters collective 20,001, rank 1 stops short of it (a hang), a late sighting of an old
    # collective arrives: the newest sighting stays and dates the hang
    entered = Progress(epoch=0, step=200, layer=1, phase="dispatch", seq=20_001)
    behind = Progress(epoch=0, step=200, layer=1, phase="compute", seq=20_000)
    detector.node_heartbeat(c.ranks, node_beat("n0", {0: 0.0, 1: 0.0}, {0: entered, 1: behind}), 0, now)
    detector.heartbeat(c.ranks[1], Progress(epoch=0, step=1, layer=0, phase="dispatch", seq=5), 0, now, now)
    c.ranks[1].progress = behind
    assert len(detector.seq_first_seen) <= SIGHTINGS_KEPT and detector.seq_first_seen[20_001] == now
    detector._checked_at = 0.0
    assert detector.check(now + 0.9, c.ranks, c.members, True, 0) == []
    detector._checked_at = 0.0
    assert [(f.rank_id, f.cause) for f in detector.check(now + 1.01, c.ranks, c.members, True, 0)] == \
        [(1, FaultCause.HUNG)]


def test_of_an_agents_messages_read_in_one_batch_the_newest_dates_its_ranks():
    """The controller read nothing for 2 s (an epoch change): n0's agent sent 20 messages meanwhile,
    rank 1 stopped before the first, and all of them arrive at one heard time. Dated by the oldest
    (the smallest age), the stopped rank would look heard 1.9 s after it stopped."""
    c = cluster_of({0: "n0", 1: "n0", 2: "n1"})
    detector = FaultDetector(config(heartbeat_timeout_s=1.0))
    stopped_at, arrival = 100.0, 102.05
    sent = [round(100.1 + INTERVAL_S * i, 3) for i in range(20)]  # the agent's clock, in send order
    batch = [node_beat("n0", {0: 0.02, 1: round(t - stopped_at, 3)}) for t in sent]
    batch.insert(5, node_beat("n1", {2: 0.01}))
    assert superseded_node_beats(batch) == set(range(21)) - {5, 20} and \
        superseded_node_beats([node_beat("n0", {0: 0.0}), NodeHeartbeat("n0", "s2", [])]) == set()
    take_batch(detector, c, batch, arrival)
    assert c.ranks[1].last_heartbeat == pytest.approx(arrival - (sent[-1] - stopped_at))
    assert lost(detector, c, arrival) == {1: FaultCause.HEARTBEAT_LOST}
    assert c.ranks[0].last_heartbeat == pytest.approx(arrival - 0.02)
