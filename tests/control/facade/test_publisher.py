"""The publisher (control/facade/publisher.py) built with stand-ins: readiness turns false, with
one `stalled` event, once the step in flight runs past the stall deadline, and back with one
`stall-ended`; health names a down rank and says dead once the loop stopped; the /cluster
snapshot carries the other roles' views and the injected delays, and is rebuilt at most once
per throttle interval; its placement is the slot map, whose size does not grow with one expert's
replicas; after a recovery's warm-up /ready opens at once and the snapshot waits for the first step."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from control_standins import cluster_of, config
from prometheus_client import CollectorRegistry

from elastic_ep.control.api import GenerationRequest
from elastic_ep.control.config import ServeConfig
from elastic_ep.control.controller import Controller
from elastic_ep.control.events import EventKind
from elastic_ep.control.facade import publisher as publisher_module
from elastic_ep.control.facade.engine import Published
from elastic_ep.control.facade.publisher import PUBLISHED_LIVENESS_S, Publisher
from elastic_ep.control.faults.detector import FaultDetector
from elastic_ep.control.faults.recovery import RecoveryRecord
from elastic_ep.control.metrics import ClusterMetrics
from elastic_ep.control.ranks import RankInfo, RankStatus
from elastic_ep.control.serving.scheduler import Sequence
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.model.tiny import resolve_model
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.policy.straggler_verdict import IntervalRecorder
from elastic_ep.wire import ClusterKey


class Rig:
    def __init__(self):
        self.cfg = config(stall_floor_s=0.5, heartbeat_suspect_s=100.0)
        self.cluster = cluster_of({0: "n0", 1: "n0"})
        self.cluster.set_readiness(True)
        self.heard = 0.0
        for r in self.cluster.ranks.values():
            r.last_heartbeat = 0.0
        self.steps = SimpleNamespace(in_step=set(), replies={}, started_at=0.0,
                                     own_time=IntervalRecorder(self.cfg.straggler_window_s), tokens_run=0,
                                     tokens_sampled=0)
        scheduler = SimpleNamespace(running={0: [], 1: []}, waiting=[], num_requests=lambda r: 0, pools={},
                                    pool_view=lambda max_model_len: {"ranks": {}})
        self.published = Published()
        self.views_asked = 0
        self.publisher = Publisher(self.cluster, self.cfg, FaultDetector(self.cfg), self.steps, scheduler,
                                   self.published, ClusterMetrics(CollectorRegistry()), heard=lambda: self.heard,
                                   controller_addr="tcp://ctl", views=self.views, slow_delays=lambda: {1: 0.25})

    def views(self, now):
        self.views_asked += 1
        return {"scale": {"scale_phase": "serving"}, "rebalance": {"active": False}}

    def kinds(self):
        return [e["kind"] for e in self.cluster.events.all()]


def test_a_step_past_the_stall_deadline_turns_readiness_false_once_and_back():
    rig = Rig()
    rig.publisher.publish()
    assert rig.published.readiness.ready and rig.published.health.status == "ok"
    rig.steps.in_step, rig.steps.started_at = {0, 1}, time.monotonic() - 5.0
    rig.publisher.publish()
    rig.publisher.publish()
    assert not rig.published.readiness.ready and "stalled" in rig.published.readiness.reason
    assert rig.kinds().count("stalled") == 1
    rig.steps.in_step = set()
    rig.publisher.publish()
    assert rig.published.readiness.ready and rig.kinds()[-1] == "stall-ended"


def test_health_names_a_down_rank_and_is_dead_once_the_loop_stopped():
    rig = Rig()
    rig.cluster.ranks[1].status = RankStatus.DEAD
    rig.publisher.publish()
    assert rig.published.health.status == "degraded" and "rank 1 dead" in rig.published.health.reason
    rig.published.fatal = "RuntimeError: boom"
    rig.publisher.publish()
    assert rig.published.health.status == "dead" and "boom" in rig.published.health.reason


def test_the_published_liveness_is_renewed_at_most_every_published_liveness_s(monkeypatch):
    """Not at every --health-check-period-s (a walk over every rank, 50 a second): the detector's
    check names the faults at that period, the published liveness serves readers that poll."""
    rig = Rig()
    walks = []
    liveness = rig.publisher.liveness
    monkeypatch.setattr(rig.publisher, "liveness", lambda now, heard: walks.append(now) or liveness(now, heard))
    now = [1000.0]
    monkeypatch.setattr(publisher_module.time, "monotonic", lambda: now[0])
    rig.publisher.publish(throttle_s=60.0)
    for _ in range(9):  # 9 pumps 10 ms apart: twice the detector's period each
        now[0] += 0.01
        rig.publisher.publish(throttle_s=60.0)
    assert len(walks) == 1
    now[0] += PUBLISHED_LIVENESS_S
    rig.publisher.publish(throttle_s=60.0)
    assert len(walks) == 2


def test_the_snapshot_carries_the_roles_views_and_is_throttled():
    rig = Rig()
    rig.publisher.publish()
    snap = rig.published.snapshot
    assert snap["scale"] == {"scale_phase": "serving"} and snap["controller"] == "tcp://ctl"
    assert {r["rank_id"]: r["slow_delay_s"] for r in snap["ranks"]} == {0: 0.0, 1: 0.25}
    rig.publisher.publish(throttle_s=60.0)
    assert rig.views_asked == 1 and rig.published.snapshot is snap


def test_the_snapshots_placement_is_the_slot_map_whatever_one_experts_replicas():
    """log2phy, padded to the hottest expert's replicas, made /cluster 64 MB after 10 minutes at 1,024 ranks: the
    snapshot sends phy2log and logcnt, from which a reader rebuilds the same placement."""
    ranks, slots, experts = 16, 2, 16
    spread = ExpertLocation.from_phy2log([list(range(experts)) * 2], slots, experts)  # 2 replicas each
    hot = ExpertLocation.from_phy2log([[0] * ranks + list(range(1, experts)) + [-1]], slots, experts)  # 0 everywhere
    sizes = {}
    for name, location in (("spread", spread), ("hot", hot)):
        rig = Rig()
        rig.cluster.location = location
        rig.publisher.publish()
        placement = rig.published.snapshot["placement"]
        assert "log2phy" not in placement
        rebuilt = ExpertLocation.from_json(json.dumps(placement))
        assert (rebuilt.log2phy == location.log2phy).all() and (rebuilt.logcnt == location.logcnt).all()
        sizes[name] = len(json.dumps(placement))
    assert hot.log2phy.shape[2] == ranks and spread.log2phy.shape[2] == 2
    assert sizes["hot"] <= sizes["spread"]


def test_a_recoverys_warm_up_opens_ready_and_leaves_the_snapshot_to_after_the_first_step():
    """The controller's publish after the warm-up of a recovery's epoch, with requests waiting:
    /ready turns true at once, the /cluster snapshot (a large build at 1,024 ranks) is not built
    before the first step closes the recovery, and is after it."""
    ctl = Controller(ServeConfig(model_dir=str(resolve_model("tiny-deepseek-v3")), model_name="t", ep_size=2),
                     ClusterKey.generate(), CollectorRegistry())
    ctl.scheduler.add(Sequence(5, GenerationRequest("r5", [1, 2, 3], SamplingParams(max_tokens=4), 0), 64, (0,)))
    ctl.recovery.record = RecoveryRecord(time.monotonic(), [1], "rank 1 exited", 0.01)
    ctl.cluster.set_readiness(False, "recovering")
    ctl.publish()
    before = ctl.engine.cluster()
    assert not before["ready"]
    ctl._warm_up(first=False)  # a group with nothing to warm: ready at once
    assert ctl.engine.readiness().ready  # what /ready answers
    assert ctl.engine.cluster()["ready"] is False  # the snapshot waits
    assert [e["kind"] for e in ctl.cluster.events.all()][-1] == EventKind.WARMUP.value
    ctl.recovery.step_completed(0.01)  # the first step
    deadline = time.monotonic() + 30
    while not ctl.engine.cluster()["ready"]:  # the loop's throttled publish, once its turn comes
        assert time.monotonic() < deadline
        ctl.publish(throttle_s=0.25)
        time.sleep(0.05)
    kinds = [e["kind"] for e in ctl.engine.cluster()["events"]]
    assert EventKind.WARMUP.value in kinds and EventKind.RECOVERED.value in kinds


def test_the_snapshot_shows_each_ranks_timing_percentiles_and_the_slot_balance_from_its_ring():
    rig = Rig()
    c = rig.cluster
    records = [c.ranks[r].record for r in (0, 1)]
    for step in range(1, 101):
        c.timings.write("step_s", [0, 1], records, [step / 1000, 2 * step / 1000])
        c.timings.write("link_s", [1], records[1:], [0.0005])
        c.timings.write("slot_tokens", [0, 1], records, [1, 3])
    rig.publisher.publish()
    ranks = {r["rank_id"]: r for r in rig.published.snapshot["ranks"]}
    assert ranks[0]["step_ms"] == {"p50": 50.5, "p99": 99.01, "max": 100.0}
    assert ranks[1]["step_ms"] == {"p50": 101.0, "p99": 198.02, "max": 200.0}
    assert ranks[0]["link_ms"] is None and ranks[1]["link_ms"] == {"p50": 0.5, "p99": 0.5, "max": 0.5}
    assert ranks[0]["own_ms"] is None and ranks[0]["wait_ms"] is None
    imbalance = rig.publisher.metrics.ranks._gauges["elastic_ep_expert_load_imbalance"]
    assert imbalance == {0: 0.5, 1: 1.5}  # the last 64 steps' slot tokens over the mean
    c.ranks[1] = RankInfo(1, "n0", pid=2001, status=RankStatus.SERVING)  # a new process of rank id 1
    rig.publisher.publish()
    assert {r["rank_id"]: r["step_ms"] for r in rig.published.snapshot["ranks"]}[1] is None


def test_a_step_boundary_builds_no_snapshot_and_the_pumps_of_a_wait_do(monkeypatch):
    """The ranks wait through a step boundary: its pump publishes readiness and health but leaves a
    due /cluster snapshot to the pumps of the next step's wait (or of an idle loop)."""
    ctl = Controller(ServeConfig(model_dir=str(resolve_model("tiny-deepseek-v3")), model_name="t", ep_size=2),
                     ClusterKey.generate(), CollectorRegistry())
    ctl.publish()
    first = ctl.published.snapshot
    time.sleep(0.3)  # past the throttle: a snapshot is due
    ctl.pump(0.0, snapshot=False)
    assert ctl.published.snapshot is first
    ctl.pump(0.0)
    assert ctl.published.snapshot is not first
    pumps = []
    monkeypatch.setattr(ctl, "pump", lambda timeout_s, snapshot=True: pumps.append((timeout_s, snapshot)))
    ctl._iterate()  # no rank yet: not ready, so it waits in a pump of its own
    assert pumps[0] == (0.0, False) and pumps[-1] == (0.05, True)
