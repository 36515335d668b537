"""The scale driver (control/membership/scale_driver.py) built with stand-ins: a scale-up takes
the standbys first, starts the rest and admits them together once all registered; a scale-down
drains the leaving ranks, moves their experts off in an epoch where they still send, then drops
and stops them; a scale fails, the service does not (timeout, no placement, a refused request). A drain is a
scale-down of the ranks named, or of a node's ranks, which cordons it."""

from __future__ import annotations

import re

import pytest
from control_standins import cluster_of, config

from elastic_ep.control.api import ScaleRejected
from elastic_ep.control.epochs.epoch_change import EpochReport, NoPlacement
from elastic_ep.control.epochs.requests import ScaleStep
from elastic_ep.control.membership.scale_driver import ScaleDriver
from elastic_ep.control.ranks import RankInfo, RankStatus
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import WorkerHello


class Processes:
    def __init__(self, cluster):
        self.cluster = cluster
        self.started, self.stopped, self.forgotten = [], [], []

    def start_new_rank(self, rank_id, node, spare=False):
        self.cluster.ranks[rank_id] = RankInfo(rank_id, node)
        self.started.append((rank_id, node))

    def forget_rank(self, rank_id, message):
        self.cluster.ranks.pop(rank_id)
        self.forgotten.append(rank_id)

    def stop_rank(self, rank_id):
        self.cluster.ranks[rank_id].status = RankStatus.RETIRING
        self.stopped.append(rank_id)

    def retire(self, rank_id, reason):
        self.cluster.ranks[rank_id].status = RankStatus.RETIRING
        self.stopped.append(rank_id)

    def release_if_drained(self, node):
        self.released = getattr(self, "released", []) + [node]


class Drains:
    def __init__(self):
        self.draining: set[int] = set()
        self.requests: dict[int, int] = {}

    def drain(self, ranks):
        self.draining |= set(ranks)

    def undrain(self, ranks):
        self.draining -= set(ranks)

    def num_requests(self, rank_id):
        return self.requests.get(rank_id, 0)


class Rig:
    """Four ranks serving on nodes n0 and n1 (8 experts, 4 slots a rank: 2 ranks hold them all), one
    standby (rank 4)."""

    def __init__(self, outcome=None, **flags):
        self.cluster = cluster_of({0: "n0", 1: "n0", 2: "n1", 3: "n1"}, experts=8, slots=4)
        self.cluster.location = ExpertLocation.from_phy2log([list(range(8)) * 2], 4, 8)
        self.cluster.ranks[4] = RankInfo(4, "n1", pid=1004, status=RankStatus.STANDBY, spare=True,
                                         hello=WorkerHello(4, "n1", 1004, "initial", device="cpu"))
        self.processes, self.drains = Processes(self.cluster), Drains()
        self.formed: list[tuple[ScaleStep, str]] = []
        self.outcome = outcome
        self.driver = ScaleDriver(self.cluster, config(**flags), self.processes, self.drains,
                                  take_standbys=lambda n: [4][:n], joiners=lambda: [], form=self.form,
                                  publish=lambda: None)

    def form(self, request, reason):
        self.formed.append((request, reason))
        if self.outcome is not None:
            return self.outcome
        c = self.cluster
        c.epoch += 1
        c.members = list(request.live)
        holding = request.holding or request.live
        for r in request.live:
            c.ranks[r].status = RankStatus.SERVING if r in holding else RankStatus.DRAINING
        return EpochReport(c.epoch, list(request.live), 0, 0, 0, 0, {}, 0, 0, "")

    def register(self, rank_id):
        self.cluster.ranks[rank_id].hello = WorkerHello(rank_id, "n0", 2000 + rank_id, "initial", device="cpu")


def test_a_scale_up_takes_the_standby_first_and_admits_every_new_rank_together():
    rig = Rig()
    assert rig.driver.request(6) == {"old_ep_size": 4, "new_ep_size": 6}
    assert rig.driver.advance() is False  # pending -> joining
    assert rig.processes.started == [(5, "n0")] and rig.driver.op.new_ranks == [4, 5]
    assert rig.driver.advance() is False and rig.driver.status()["scale_phase"] == "waiting_for_cohort"
    assert rig.formed == []
    rig.register(5)
    assert rig.driver.advance() is True
    assert rig.formed == [(ScaleStep([0, 1, 2, 3, 4, 5]), "scale-up to 6 ranks")]
    assert rig.driver.status()["scale_phase"] == "serving_expanded" and rig.driver.target_ep_size == 6


def test_a_scale_down_drains_moves_the_experts_off_then_drops_and_stops_the_leaving_ranks():
    rig = Rig(scale_drain_timeout_s=60.0)
    rig.driver.request(2)
    rig.driver.advance()
    leaving = rig.driver.op.retiring
    assert len(leaving) == 2 and rig.drains.draining == set(leaving)
    assert all(rig.cluster.ranks[r].status == RankStatus.DRAINING for r in leaving)
    rig.drains.requests = {leaving[0]: 1}
    assert rig.driver.advance() is False and rig.formed == []  # still draining a request
    rig.drains.requests = {}
    assert rig.driver.advance() is True
    keep = [r for r in (0, 1, 2, 3) if r not in leaving]
    (first, _), (second, _) = rig.formed
    assert first == ScaleStep([0, 1, 2, 3], holding=keep)  # the leaving ranks still send
    assert second.live == keep and second.target is not None
    assert rig.processes.stopped == leaving and rig.driver.status()["scale_phase"] == "serving_shrunk"


def test_a_scale_that_runs_out_of_time_stops_its_joiners_and_the_old_group_serves_on():
    rig = Rig(elastic_ep_scale_timeout_s=0.0)
    rig.driver.request(6)
    rig.driver.op.new_ranks = [5]
    rig.cluster.ranks[5] = RankInfo(5, "n0")
    assert rig.driver.advance() is False
    status = rig.driver.status()
    assert status["scale_phase"] == "failed" and "--elastic-ep-scale-timeout" in status["last_error"]
    assert rig.processes.stopped == [5] and rig.formed == [] and rig.cluster.members == [0, 1, 2, 3]


def test_a_scale_with_no_placement_over_its_ranks_fails_and_undrains():
    rig = Rig(outcome=NoPlacement("no placement over ranks [0, 1]: test"))
    rig.driver.request(2)
    rig.driver.advance()
    leaving = list(rig.driver.op.retiring)
    assert rig.driver.advance() is False  # the first scale-down epoch found no placement
    assert rig.driver.status()["last_error"] == "no placement over ranks [0, 1]: test"
    assert rig.drains.draining == set() and all(rig.cluster.ranks[r].status == RankStatus.SERVING for r in leaving)
    assert rig.processes.stopped == []


def test_a_scale_is_refused_before_the_first_epoch_and_beyond_the_limits():
    rig = Rig()
    rig.cluster.epoch = -1
    with pytest.raises(ScaleRejected, match="still starting"):
        rig.driver.request(6)
    rig.cluster.epoch = 0
    with pytest.raises(ScaleRejected):
        rig.driver.request(1)  # 4 slots cannot hold 8 experts on one rank


def test_a_scale_down_given_its_ranks_retires_those_not_the_highest():
    rig = Rig(scale_drain_timeout_s=0.0)
    assert rig.driver.request(3, [1]) == {"old_ep_size": 4, "new_ep_size": 3}
    rig.driver.advance()
    assert rig.driver.op.retiring == [1] and rig.drains.draining == {1}
    assert rig.driver.advance() is True
    (first, _), (second, _) = rig.formed
    assert first == ScaleStep([0, 1, 2, 3], holding=[0, 2, 3]) and second.live == [0, 2, 3]
    assert rig.processes.stopped == [1] and rig.driver.status()["scale_phase"] == "serving_shrunk"
    assert rig.driver.target_ep_size == 3


def test_a_drain_of_a_node_cordons_it_retires_its_ranks_and_its_standby():
    rig = Rig(scale_drain_timeout_s=0.0)
    answer = rig.driver.drain(None, "n1")
    assert answer == {"ranks": [2, 3], "node": "n1", "old_ep_size": 4, "new_ep_size": 2}
    assert rig.cluster.cordoned == {"n1"} and rig.processes.stopped == [4]  # the standby on n1
    rig.driver.advance()
    assert rig.driver.advance() is True
    assert rig.cluster.members == [0, 1] and rig.processes.stopped == [4, 2, 3]
    assert rig.driver.status()["drained_node"] == "n1"
    rig.driver.request(4)
    rig.driver.advance()
    assert {node for _, node in rig.processes.started} == {"n0"}  # a cordoned node gets no new rank
    rig.driver.op.finish("failed")
    assert rig.driver.uncordon("n1") == {"node": "n1", "cordoned": False} and rig.cluster.cordoned == set()


@pytest.mark.parametrize("ranks,node,status,needle", [
    ([9], None, 400, "ranks [9] are not in the group"),
    ([1, 1], None, 400, "twice"),
    ([], None, 400, "no ranks"),
    ([0, 1, 2], None, 400, "fewer than the 2 that hold every expert"),
    (None, "n7", 400, "no node 'n7'"),
    ([1], "n0", 400, "not both"),
])
def test_impossible_drains_are_refused_naming_the_problem(ranks, node, status, needle):
    rig = Rig()
    with pytest.raises(ScaleRejected, match=re.escape(needle)) as e:
        rig.driver.drain(ranks, node)
    assert e.value.status == status and rig.cluster.cordoned == set() and rig.driver.op is None


def test_a_drain_while_a_scale_is_in_flight_is_409_and_leaves_the_node_uncordoned():
    rig = Rig()
    rig.driver.request(6)
    with pytest.raises(ScaleRejected, match="in flight") as e:
        rig.driver.drain(None, "n1")
    assert e.value.status == 409 and rig.cluster.cordoned == set()
    with pytest.raises(ScaleRejected, match="not cordoned"):
        rig.driver.uncordon("n1")


def test_a_scale_given_ranks_that_do_not_match_its_size_is_400():
    with pytest.raises(ScaleRejected, match="leaves 3 ranks, not new_ep_size 2") as e:
        Rig().driver.request(2, [1])
    assert e.value.param == "ranks"


def in_flight(**fields) -> dict:
    """A last leader's GET /is_scaling_elastic_ep with a scale in flight, as its cluster record holds it."""
    return {"is_scaling_elastic_ep": True, "old_ep_size": 4, "new_ep_size": 5, "new_ranks": [], "retiring": [],
            "drained_node": None, "scale_phase": "waiting_for_cohort", "target_ep_size": 4, **fields}


def test_a_new_leader_resumes_a_scale_up_with_the_process_the_last_one_started_and_starts_none():
    rig = Rig()  # rank 4: the joiner the last leader started, adopted as it runs, stands by here
    rig.driver.take_target(in_flight(new_ranks=[4]))
    assert rig.driver.resume(in_flight(new_ranks=[4]), {"active": False}) == "resumed"
    rig.driver.advance()
    assert rig.driver.op.new_ranks == [4] and rig.processes.started == []
    assert rig.driver.advance() is True and rig.formed == [(ScaleStep([0, 1, 2, 3, 4]), "scale-up to 5 ranks")]
    assert rig.driver.status()["scale_phase"] == "serving_expanded" and rig.driver.target_ep_size == 5
    assert any(e["kind"] == "scale" and e.get("resumed") for e in rig.cluster.events.all())


def test_a_resumed_scale_up_waits_for_the_joiner_still_loading_and_admits_it():
    """Rank 5, started by the last leader's scale, still loads its weights (adopted as it runs, not
    registered yet): the resumed scale takes it as its joiner, starts nothing and forms no epoch until
    it registers, then admits it (not finished at the old size, the joiner left for a later rejoin)."""
    rig = Rig()
    rig.cluster.ranks[5] = RankInfo(5, "n0", pid=1005, status=RankStatus.STARTING)
    last = in_flight(new_ep_size=6, new_ranks=[4, 5])
    rig.driver.take_target(last)
    assert rig.driver.resume(last, {"active": False}) == "resumed"
    assert rig.driver.advance() is False and rig.driver.advance() is False
    assert sorted(rig.driver.op.new_ranks) == [4, 5] and rig.processes.started == [] and rig.formed == []
    assert rig.driver.status()["scale_phase"] == "waiting_for_cohort"
    rig.register(5)
    assert rig.driver.advance() is True and rig.formed == [(ScaleStep([0, 1, 2, 3, 4, 5]), "scale-up to 6 ranks")]
    assert rig.driver.status()["scale_phase"] == "serving_expanded" and rig.driver.target_ep_size == 6


def test_a_new_leader_resumes_a_scale_down_with_its_leaving_ranks_and_a_drain_with_its_node():
    rig = Rig(scale_drain_timeout_s=60.0)
    assert rig.driver.resume(in_flight(new_ep_size=3, retiring=[1], scale_phase="draining"), {}) == "resumed"
    rig.driver.advance()
    assert rig.driver.op.retiring == [1] and rig.drains.draining == {1}  # not the highest id: the one it named
    rig = Rig(scale_drain_timeout_s=60.0)
    assert rig.driver.resume(in_flight(new_ep_size=2, retiring=[2, 3], drained_node="n1"), {}) == "resumed"
    rig.driver.advance()
    assert "n1" in rig.cluster.cordoned and rig.driver.op.retiring == [2, 3] and rig.driver.op.node == "n1"


def test_a_rolling_restarts_scale_is_not_resumed_and_one_that_no_longer_applies_is_refused():
    rig = Rig()
    rollout = {"state": "running", "active": True, "rank_in_flight": 2, "phase": "starting"}
    assert rig.driver.resume(in_flight(), rollout) == "ended" and rig.driver.op is None
    assert any("rolling restart" in e["message"] for e in rig.cluster.events.all() if e["kind"] == "scale-failed")
    assert rig.driver.resume({"is_scaling_elastic_ep": False, "target_ep_size": 4}, {}) == "none"
    assert rig.driver.resume(in_flight(new_ep_size=3, retiring=[9]), {}) == "refused" and not rig.driver.active
    rig.driver.take_target({"target_ep_size": 6})
    assert rig.driver.target_ep_size == 6 and rig.driver.status()["target_ep_size"] == 6


def test_a_scale_down_recorded_before_it_began_is_resumed_with_the_ranks_it_named():
    last = Rig(scale_drain_timeout_s=60.0)
    last.driver.request(None, [1])
    recorded = last.driver.status()  # what the record written with its answer holds: not begun yet
    rig = Rig(scale_drain_timeout_s=60.0)
    assert rig.driver.resume(recorded, {}) == "resumed"
    rig.driver.advance()
    assert rig.driver.op.retiring == [1] and rig.drains.draining == {1}  # the one named, not the highest id
