"""Which ranks from outside join an epoch and which stand by, and how many spares to start."""

from elastic_ep.control.membership.standbys import admission, processes_to_start
from elastic_ep.control.ranks import RankInfo


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
