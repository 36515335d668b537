"""The scale driver (control/membership/scale_driver.py) built with stand-ins: a scale-up takes
the standbys first, starts the rest and admits them together once all registered; a scale-down
drains the leaving ranks, moves their experts off in an epoch where they still send, then drops
and stops them; a scale fails, the service does not (timeout, no placement, a refused request)."""

from __future__ import annotations

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
