"""The background slot sweep deals its requests over the interval: between two steps it asks
only the members whose turn came (not every member at once), every member is asked once per
interval, each for its next occupied slots in turn."""

from __future__ import annotations

from control_standins import Plane, cluster_of, config

from elastic_ep.control.epochs import slot_check
from elastic_ep.control.epochs.slot_check import SlotSweeper
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import SweepSlots


def test_members_are_asked_in_turn_over_the_interval(monkeypatch):
    ranks = {r: f"n{r // 4}" for r in range(8)}
    c = cluster_of(ranks, experts=8, slots=2, members=list(range(8)))
    c.location = ExpertLocation.from_phy2log([list(range(8)) * 2], 2, 8)  # 2 slots a rank, all occupied
    plane = Plane()
    sweeper = SlotSweeper(c, config(ep_size=8, expert_sweep_interval_s=1.0, expert_sweep_slots=1), plane, None)
    now = [100.0]
    monkeypatch.setattr(slot_check.time, "monotonic", lambda: now[0])
    sweeper.sweep()  # the first call: everyone is due
    assert sorted(r for r, _ in plane.to_workers) == list(range(8))
    plane.to_workers.clear()
    asked = []
    for _ in range(8):  # eight calls over one interval: one member each
        now[0] += 0.125
        sweeper.sweep()
        asked.append([r for r, _ in plane.to_workers])
        plane.to_workers.clear()
    assert asked == [[r] for r in range(8)]
    for _ in range(8):
        now[0] += 0.125
        sweeper.sweep()
    second = [(r, m.slots) for r, m in plane.to_workers if isinstance(m, SweepSlots)]
    assert [r for r, _ in second] == list(range(8))
    assert all(slots == [(0, 0)] for _, slots in second)  # after (0, 1) in the first round: the next in turn
