"""Which ranks from outside join an epoch and which stand by, and how many spares to start.

The standbys role (control/membership/standbys.py) built with stand-ins: registered ranks the
group does not need stand by; a rank with a pending fault or started by a scale is never
admitted; the upkeep starts spares to cover the shortfall plus --standby-ranks and owed
replacements; a lost standby is retired, never a fault."""

from __future__ import annotations

from control_standins import cluster_of

from elastic_ep.control.membership.standbys import Standbys, admission, processes_to_start
from elastic_ep.control.ranks import RankInfo, RankStatus
from elastic_ep.wire import WorkerHello


def test_restarted_members_join_first_then_standbys_then_new_spares_and_the_rest_stand_by():
    registered = [RankInfo(7, "n", spare=True), RankInfo(2, "n")]
    assert admission(registered, [5], shortfall=1).admit == [2]
    plan = admission(registered, [5], shortfall=2)
    assert plan.admit == [2, 5] and plan.park == [7]
    assert admission(registered, [5], shortfall=0).park == [2, 7]
    assert admission(registered, [5], shortfall=-1).admit == []


def test_spares_cover_the_shortfall_and_the_standbys_wanted_and_nothing_without_standbys():
    assert processes_to_start(wanted=1, shortfall=0, coming=0) == 1
    assert processes_to_start(wanted=1, shortfall=1, coming=1) == 1  # the one coming fills the group
    assert processes_to_start(wanted=2, shortfall=0, coming=3) == 0
    assert processes_to_start(wanted=0, shortfall=2, coming=0) == 0  # restarts refill the group, as without standbys


class Processes:
    def __init__(self, cluster):
        self.cluster = cluster
        self.started, self.retired, self.restarts = [], [], set()

    def start_new_rank(self, rank_id, node, spare=False):
        self.cluster.ranks[rank_id] = RankInfo(rank_id, node, spare=spare)
        self.started.append((rank_id, node, spare))

    def retire(self, rank_id, reason):
        self.cluster.ranks[rank_id].status = RankStatus.RETIRING
        self.retired.append((rank_id, reason))

    def restarting(self, rank_id):
        return rank_id in self.restarts


def registered(cluster, rank_id: int, node: str = "n0", spare: bool = True) -> None:
    cluster.ranks[rank_id] = RankInfo(rank_id, node, pid=2000 + rank_id, spare=spare,
                                      hello=WorkerHello(rank_id, node, 2000 + rank_id, "initial", device="cpu"))


def rig(wanted: int = 1, faulted=frozenset(), joiners=frozenset()):
    cluster = cluster_of({0: "n0", 1: "n0", 2: "n1"})
    processes = Processes(cluster)
    standbys = Standbys(cluster, wanted, processes, target_size=lambda: 3, joiner=lambda r: r in joiners,
                        faulted=lambda r: r in faulted)
    return cluster, processes, standbys


def test_registered_ranks_beyond_the_target_stand_by_and_are_taken_when_the_group_is_short():
    cluster, _, standbys = rig()
    registered(cluster, 3)
    standbys.park()
    assert cluster.ranks[3].status == RankStatus.STANDBY and standbys.ready() == [3]
    assert standbys.joiners([0, 1, 2]) == [] and standbys.joiners([0, 2]) == [3]


def test_a_rank_with_a_pending_fault_or_a_scales_joiner_is_not_admitted():
    cluster, _, standbys = rig(faulted={3}, joiners={4})
    registered(cluster, 3, spare=False)
    registered(cluster, 4, spare=False)
    assert standbys.joiners([0, 2]) == []


def test_the_upkeep_starts_spares_for_the_shortfall_and_the_standbys_wanted_and_replacements_owed():
    cluster, processes, standbys = rig(wanted=1)
    standbys.upkeep()
    assert [(r, spare) for r, _, spare in processes.started] == [(3, True)]
    standbys.upkeep()  # rank 3 is on its way: nothing more
    assert len(processes.started) == 1

    cluster, processes, standbys = rig(wanted=0)
    standbys.replace_later(1)
    standbys.upkeep()
    assert len(processes.started) == 1 and standbys.owed == []


def test_a_lost_standby_is_retired_not_a_fault():
    cluster, processes, standbys = rig()
    registered(cluster, 3)
    standbys.park()
    standbys.lost(3, "no heartbeat")
    assert processes.retired == [(3, "standby lost: no heartbeat")] and standbys.ready() == []
