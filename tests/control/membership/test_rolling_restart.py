"""The rolling restart (control/membership/rollout_rules.py, the rules; rolling_restart.py, the
driver) built with stand-ins for the scale driver and the rank processes: every process is
replaced one rank at a time (drain, stop, start on its node, rejoin), an old standby goes first
and, with standbys, a new standby takes each member's place before it leaves, a group that could not lose a rank
is refused (409), abort lets the rank in flight finish and touches no other, a failed step
fails the rollout with the reason, bad options are refused (400)."""

from __future__ import annotations

import pytest
from control_standins import cluster_of, config

from elastic_ep.control.api import ScaleRejected
from elastic_ep.control.membership.rolling_restart import RollingRestart
from elastic_ep.control.membership.rollout_rules import GroupView, next_turn, old_processes, refusal
from elastic_ep.control.membership.scale_rules import ScaleOp
from elastic_ep.control.ranks import RankInfo, RankStatus
from elastic_ep.wire import WorkerHello


class Scaling:
    """The scale driver's face: records each request; the test ends the scale with `finish`."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.op: ScaleOp | None = None
        self.requests: list[tuple[int | None, list[int] | None, str | None]] = []

    @property
    def active(self) -> bool:
        return self.op is not None and self.op.active

    def request(self, new_ep_size, ranks=None, node=None, param="ranks", start_on=None):
        assert not self.active, "one scale at a time"
        self.requests.append((new_ep_size, ranks, start_on))
        size = len(self.cluster.members)
        self.op = ScaleOp(size, new_ep_size if new_ep_size is not None else size - len(ranks), chosen=ranks,
                          start_on=start_on)
        return {}


class Processes:
    def __init__(self, cluster):
        self.cluster = cluster
        self.options: dict = {}
        self.retired: list[int] = []

    def retire(self, rank_id, reason):
        self.cluster.ranks[rank_id].status = RankStatus.RETIRING
        self.retired.append(rank_id)


class Rig:
    """Ranks 0, 1 on n0 and 2 on n1 serving (8 experts, 4 slots a rank: 2 ranks hold them all),
    optionally a standby rank 3 on n1."""

    def __init__(self, ranks=None, standby=False, model_problem="", **flags):
        self.cluster = c = cluster_of(ranks or {0: "n0", 1: "n0", 2: "n1"}, experts=8, slots=4)
        c.set_readiness(True)
        if standby:
            self.add_standby(3, "n1", 1003)
        self.scaling, self.processes = Scaling(c), Processes(c)
        self.next_pid = 2000
        self.driver = RollingRestart(c, config(ep_size=len(c.members), **flags), self.scaling, self.processes,
                                     standbys=lambda: sorted(r.rank_id for r in c.ranks.values()
                                                             if r.status == RankStatus.STANDBY),
                                     check_model=lambda path: model_problem, publish=lambda: None)

    def add_standby(self, rank_id, node, pid):
        self.cluster.ranks[rank_id] = RankInfo(rank_id, node, pid=pid, status=RankStatus.STANDBY, spare=True,
                                               hello=WorkerHello(rank_id, node, pid, "initial", device="cpu"))

    def process_exits(self, rank_id):
        self.cluster.ranks.pop(rank_id)

    def finish_scale(self, fail: str = ""):
        """End the scale in flight as the scale driver would: members change, a joiner serves."""
        c, op = self.cluster, self.scaling.op
        assert op is not None and op.active
        if fail:
            op.finish("failed", fail)
            return
        if op.up:
            standbys = [r.rank_id for r in c.ranks.values() if r.status == RankStatus.STANDBY]
            if standbys:
                joiner = standbys[0]
            else:
                joiner = min(set(range(10)) - set(c.ranks))
                self.next_pid += 1
                c.ranks[joiner] = RankInfo(joiner, op.start_on or "n0", pid=self.next_pid)
            c.ranks[joiner].status = RankStatus.SERVING
            op.new_ranks = [joiner]
            c.members = sorted(c.members + [joiner])
            op.finish("serving_expanded")
        else:
            for r in op.chosen:
                c.ranks[r].status = RankStatus.RETIRING
            c.members = [r for r in c.members if r not in op.chosen]
            op.finish("serving_shrunk")

    def phase(self):
        self.driver.advance()
        return self.driver.op.rank_id, self.driver.op.phase


def test_every_rank_is_drained_stopped_restarted_on_its_node_and_rejoins_one_at_a_time():
    rig = Rig()
    view = rig.driver.request({"num_gpu_blocks_override": 64})
    assert view["state"] == "running" and view["total"] == 3 and view["pending"] == [0, 1, 2]
    assert rig.processes.options == {"num_gpu_blocks_override": 64}  # every process started from now on
    for rank, node in [(0, "n0"), (1, "n0"), (2, "n1")]:
        assert rig.phase() == (rank, "draining")
        assert rig.scaling.requests[-1] == (None, [rank], None)
        rig.finish_scale()
        assert rig.phase() == (rank, "stopping")
        assert rig.phase() == (rank, "stopping")  # its process has not exited yet
        rig.process_exits(rank)
        assert rig.phase() == (rank, "starting")
        assert rig.scaling.requests[-1] == (3, None, node)  # back to 3 ranks, on the node it ran on
        assert rig.driver.status()["rank_in_flight"] == rank
        rig.finish_scale()
        rig.driver.advance()
        assert rig.driver.op.replaced[-1] == {"rank_id": rank, "old_pid": 1000 + rank, "plan": "restart",
                                              "new_rank_id": rank, "new_pid": rig.next_pid,
                                              "took_s": rig.driver.op.replaced[-1]["took_s"]}
    rig.driver.advance()
    view = rig.driver.status()
    assert view["state"] == "done" and view["pending"] == [] and view["replaced_count"] == 3
    assert len(rig.scaling.requests) == 6 and not rig.driver.active


def test_an_old_standby_goes_first_then_a_new_standby_takes_each_members_place():
    rig = Rig(standby=True, standby_ranks=1)
    assert rig.driver.request({})["pending"] == [0, 1, 2, 3]
    assert rig.phase() == (3, "retiring_standby") and rig.processes.retired == [3]
    rig.process_exits(3)
    rig.driver.advance()
    assert rig.driver.op.replaced[-1]["plan"] == "standby"
    rig.add_standby(4, "n1", 2004)  # the upkeep's new standby registered
    assert rig.phase() == (0, "taking_standby")
    assert rig.scaling.requests[-1] == (4, None, None)  # the group grows first: never fewer ranks
    rig.finish_scale()
    assert rig.phase() == (0, "draining") and rig.scaling.requests[-1] == (None, [0], None)
    rig.finish_scale()
    assert rig.phase() == (0, "stopping")
    rig.process_exits(0)
    rig.driver.advance()
    assert rig.driver.op.replaced[-1] == {"rank_id": 0, "old_pid": 1000, "plan": "surge", "new_rank_id": 4,
                                          "new_pid": 2004, "took_s": rig.driver.op.replaced[-1]["took_s"]}
    assert rig.cluster.members == [1, 2, 4]
    # no standby ready yet: the next member waits for one rather than leave the group short
    assert rig.phase() == (None, None) and rig.driver.status()["waiting"].startswith("waiting for a new standby")
    rig.add_standby(0, "n0", 2010)
    assert rig.phase() == (1, "taking_standby")


def test_a_group_that_cannot_lose_a_rank_is_refused_unless_a_standby_can_take_its_place():
    rig = Rig({0: "n0", 1: "n1"})  # 2 ranks, and 2 hold every expert
    with pytest.raises(ScaleRejected) as refused:
        rig.driver.request({})
    assert refused.value.status == 409 and "2 are needed to hold every expert" in str(refused.value)
    assert "--standby-ranks 1" in str(refused.value) and rig.driver.op is None
    assert rig.processes.options == {}  # a refused rollout changes nothing

    waits = Rig({0: "n0", 1: "n1"}, standby_ranks=1)  # a standby is wanted: it waits for one
    waits.driver.request({})
    waits.driver.advance()
    assert waits.driver.status()["waiting"].startswith("waiting for a new standby")
    waits.add_standby(3, "n1", 2003)
    assert waits.phase() == (0, "taking_standby")
    with pytest.raises(ScaleRejected, match="--max-ep-size above the group"):  # no room for a standby to join
        Rig({0: "n0", 1: "n1"}, standby_ranks=1, max_ep_size=2).driver.request({})


def test_abort_lets_the_rank_in_flight_finish_and_replaces_no_other():
    rig = Rig()
    with pytest.raises(ScaleRejected) as none:
        rig.driver.abort()
    assert none.value.status == 409 and "no rolling restart is in flight" in str(none.value)
    rig.driver.request({})
    assert rig.phase() == (0, "draining")
    assert rig.driver.abort()["state"] == "aborting"
    rig.finish_scale()
    assert rig.phase() == (0, "stopping")
    rig.process_exits(0)
    assert rig.phase() == (0, "starting")  # it finishes: the group is whole again
    rig.finish_scale()
    rig.driver.advance()
    view = rig.driver.status()
    assert view["state"] == "aborted" and [r["rank_id"] for r in view["replaced"]] == [0]
    assert view["pending"] == [1, 2] and len(rig.scaling.requests) == 2 and not rig.driver.active
    with pytest.raises(ScaleRejected):
        rig.driver.abort()


def test_abort_between_ranks_ends_at_once():
    rig = Rig({0: "n0", 1: "n1"}, standby_ranks=1)
    rig.driver.request({})
    rig.driver.advance()  # waiting for a standby: no rank in flight
    assert rig.driver.abort()["state"] == "aborted" and rig.scaling.requests == []


def test_a_step_that_fails_fails_the_rollout_and_says_where_the_group_stands():
    rig = Rig()
    rig.driver.request({})
    rig.phase()
    rig.finish_scale()
    rig.phase()
    rig.process_exits(0)
    rig.phase()
    rig.finish_scale(fail="joining rank 0 failed: exited with code 1")
    rig.driver.advance()
    view = rig.driver.status()
    assert view["state"] == "failed" and "rank 0 (starting): joining rank 0 failed" in view["error"]
    assert "serves at 2 ranks, not 3" in view["error"] and not rig.driver.active
    with pytest.raises(ScaleRejected, match="2 are needed"):  # a new one is judged on the group as it is
        rig.driver.request({})


def test_bad_requests_are_refused_with_400_or_409():
    def refused(rig, options):
        with pytest.raises(ScaleRejected) as e:
            rig.driver.request(options)
        return e.value.status, str(e.value)

    status, why = refused(Rig(), {"max_num_seqs": 4})
    assert status == 400 and "max_num_seqs" in why and "model_dir" in why
    assert refused(Rig(model_problem="another config"), {"model_dir": "/x"}) == (400, "another config")
    rig = Rig()
    rig.cluster.ranks[1].status = RankStatus.DEAD
    rig.cluster.members = [0, 2]
    status, why = refused(rig, {})
    assert status == 409 and "ranks [1] are not serving" in why
    busy = Rig()
    busy.scaling.request(4)
    assert refused(busy, {})[0] == 409
    running = Rig()
    running.driver.request({})
    running.driver.advance()
    status, why = refused(running, {})
    assert status == 409 and "rolling restart is in flight (rank 0, draining)" in why
    assert "POST /rolling_restart/abort" in running.driver.busy()


def test_the_next_turn_and_the_refusal_are_pure_rules():
    def view(**kw):
        base = dict(old_standbys=[], old_members=[0, 1, 2], new_standbys=[], size=3, fewest=2, most=6,
                    standbys_wanted=0)
        return GroupView(**{**base, **kw})

    assert next_turn(view(old_standbys=[5])).plan == "standby"
    assert next_turn(view(new_standbys=[7])).plan == "surge"
    assert next_turn(view(new_standbys=[7], most=3)).plan == "restart"  # no room to grow: restart in place
    assert next_turn(view()).plan == "restart"
    assert next_turn(view(standbys_wanted=1)).plan == "wait"  # a standby is on its way: capacity is held
    assert next_turn(view(standbys_wanted=1, most=3)).plan == "restart"
    assert next_turn(view(size=2, old_members=[0, 1])).plan == "stuck"
    assert next_turn(view(size=2, old_members=[0, 1], standbys_wanted=1)).plan == "wait"
    assert next_turn(view(old_members=[])).plan == "done"
    assert refusal(view(size=2, old_members=[0, 1])) and not refusal(view(size=2, old_members=[0, 1],
                                                                          standbys_wanted=1))
    # a rank that died and came back during the rollout already runs the new options
    assert old_processes({0: 1000, 1: 2001, 2: 1002}, {0: 1000, 1: 1001, 2: 1002}) == [0, 2]
