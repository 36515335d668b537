"""A new leader's takeover of the running ranks (control/membership/adoption.py), with stand-ins:
the cluster record read as a plan, an agent's adopt hello making its running workers this
controller's ranks (another process holding a rank id is stopped), the adopted rank's registration
counting no weight load, the ranks that hold the record's placement whole told apart from one an
unfinished epoch was changing, an epoch numbered past every one a rank was told of, and a member
that never came back left down and restarted by its agent; the plan carries the scale and rollout
in flight, and a joiner an agent named does not hold the takeover up; a new leader (a real
Controller) keeps the nodes the record names cordoned."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
from control_standins import Plane, config
from prometheus_client import CollectorRegistry

from elastic_ep.control.cluster import ClusterState
from elastic_ep.control.config import ServeConfig
from elastic_ep.control.controller import Controller
from elastic_ep.control.membership.adoption import Adoption, adopted, adoption_plan
from elastic_ep.control.membership.nodes import Nodes
from elastic_ep.control.ranks import RankStatus
from elastic_ep.model.tiny import resolve_model
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import AgentHello, AgentWelcome, ClusterKey, FenceWorker, StartWorker, WorkerHello

PLACEMENT = ExpertLocation.from_phy2log(np.array([[0, 1, 2, 3, 4, 5, 6, 7]]), 4, 8)


def record(epoch: int = 3, members=(0, 1)) -> dict:
    return {"term": 7, "epoch": epoch, "members": list(members), "placement": json.loads(PLACEMENT.to_json()),
            "ranks": [{"rank_id": r, "node": "n0", "pid": 100 + r, "state": "serving"} for r in members],
            "agents": [], "scale": {}}


def adopt_hello(rank_id: int, pid: int, epoch: int = 3, held_epoch: int = 3) -> WorkerHello:
    return WorkerHello(rank_id, "n0", pid, "adopt", "host_memory", device="cpu", kv_blocks=64, dense_bytes=1 << 20,
                       epoch=epoch, held_epoch=held_epoch)


class Rig:
    def __init__(self, **flags):
        self.cluster = ClusterState(num_layers=1, num_experts=8, slots_per_rank=4)
        self.plane = Plane()
        self.nodes = Nodes(self.cluster, config(**flags), self.plane, 29500, 1024, fault=lambda f: None,
                           target_size=lambda: 2, undrain=lambda ranks: None, forget_measures=lambda r: None,
                           pump=lambda timeout_s: None, publish=lambda: None, set_pool_size=lambda r, b: None)

    def agent_adopts(self, running: list[tuple[int, int]], node: str = "n0") -> None:
        self.nodes.on_agent_hello(f"a{node}".encode(), AgentHello(node, 9, "tcp://f", 0, num_ranks=2,
                                                                  join_mode="adopt", session="s2", running=running))


def test_a_record_without_a_formed_epoch_is_nothing_to_adopt():
    assert adoption_plan(None) is None
    assert adoption_plan({**record(), "epoch": -1}) is None
    assert adoption_plan({**record(), "placement": None}) is None
    plan = adoption_plan(record(epoch=0))  # the first epoch is epoch 0
    assert plan is not None and plan.epoch == 0 and plan.members == [0, 1] and plan.nodes == {0: "n0", 1: "n0"}
    assert np.array_equal(plan.placement.phy2log, PLACEMENT.phy2log)


def test_an_adopting_agent_hands_over_its_running_workers_and_starts_none():
    rig = Rig()
    rig.agent_adopts([(0, 100), (1, 101)])
    assert [type(m) for _, m in rig.plane.to_identities] == [AgentWelcome]
    assert rig.plane.sent(StartWorker) == []
    assert {r: (i.node, i.pid, i.status) for r, i in rig.cluster.ranks.items()} == {
        0: ("n0", 100, RankStatus.STARTING), 1: ("n0", 101, RankStatus.STARTING)}
    rig.nodes.on_worker_hello(adopt_hello(0, 100))
    assert rig.cluster.ranks[0].hello is not None
    assert rig.cluster.loads.by_node() == {}  # it loaded nothing under this leader


def test_a_rank_id_another_process_holds_is_stopped_not_adopted():
    rig = Rig()
    rig.agent_adopts([(0, 100)])
    rig.nodes.on_worker_hello(adopt_hello(0, 100))
    rig.agent_adopts([(0, 555)], node="n1")
    assert [(m.rank_id, m.pid, m.final) for m in rig.plane.sent(FenceWorker)] == [(0, 555, True)]
    assert rig.cluster.ranks[0].pid == 100


def test_the_adoption_epoch_keeps_the_placement_on_ranks_that_hold_it_whole_and_numbers_past_all():
    plan = adoption_plan(record(epoch=3, members=(0, 1, 2)))
    # rank 1 was told of epoch 4 (the record lags one write) and began changing its slots for it
    live, whole, after = adopted(plan, {0: adopt_hello(0, 100), 1: adopt_hello(1, 101, epoch=4, held_epoch=-1)})
    assert live == [0, 1] and whole == [0] and after == 4


def test_the_wait_ends_once_every_member_is_back_and_a_missing_one_is_restarted_by_its_agent():
    rig = Rig(restart_delay_s=5.0, lease_s=30.0)
    adoption = Adoption(adoption_plan(record(members=(0, 1))), rig.cluster, rig.nodes.cfg, rig.nodes,
                        pump=lambda timeout_s: None)
    rig.agent_adopts([(0, 100)])  # rank 1 died with the old leader: its agent does not name it
    rig.nodes.on_worker_hello(adopt_hello(0, 100))
    assert adoption.settled()
    adoption.wait(threading.Event())  # returns at once: nothing more is coming
    live, whole, after = adoption.request()
    assert (live, whole, after) == ([0], [0], 3)
    assert rig.cluster.ranks[1].status == RankStatus.DEAD and rig.nodes.restarting(1)
    assert [e for e in rig.cluster.events.all() if e["kind"] == "adopted" and e["rank_id"] is None][0]["adopted"] == [0]



def test_the_plan_carries_the_scale_and_rollout_in_flight_and_a_joiner_does_not_hold_the_takeover_up():
    scale = {"is_scaling_elastic_ep": True, "old_ep_size": 2, "new_ep_size": 3, "new_ranks": [2]}
    plan = adoption_plan({**record(members=(0, 1)), "scale": scale, "rollout": {"active": False}})
    assert plan.scale == scale and plan.rollout == {"active": False}
    rig = Rig()
    adoption = Adoption(plan, rig.cluster, rig.nodes.cfg, rig.nodes, pump=lambda timeout_s: None)
    rig.agent_adopts([(0, 100), (1, 101), (2, 102)])  # rank 2: started by the last leader's scale-up
    rig.nodes.on_worker_hello(adopt_hello(0, 100))
    rig.nodes.on_worker_hello(adopt_hello(1, 101))
    assert adoption.settled() and adoption.request()[0] == [0, 1]  # the members are back: the epoch forms
    assert rig.cluster.ranks[2].status == RankStatus.STARTING  # on its way: a resumed scale starts none for it


def test_a_new_leader_keeps_the_nodes_the_last_one_cordoned_until_uncordoned():
    ctl = Controller(ServeConfig(model_dir=str(resolve_model("tiny-deepseek-v3")), model_name="t", ep_size=2),
                     ClusterKey.generate(), CollectorRegistry())
    ctl.adopt({**record(), "cordoned": ["n1"]})
    ctl.start()
    try:
        deadline = time.monotonic() + 30
        while ctl.engine.cluster().get("cordoned") != ["n1"]:  # /cluster, as the operator sees it
            assert time.monotonic() < deadline, ctl.engine.cluster().get("cordoned")
            time.sleep(0.05)
        # cordoned here, not only shown: POST /uncordon lifts it (a node not cordoned is a 400)
        assert asyncio.run(ctl.engine.uncordon("n1")) == {"node": "n1", "cordoned": False}
    finally:
        ctl.stop()
