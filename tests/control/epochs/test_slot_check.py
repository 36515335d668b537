"""The background slot sweep deals its requests over the interval: between two steps it asks
only the members whose turn came (not every member at once), every member is asked once per
interval, each for its next occupied slots in turn; after a pause it goes on at its pace, never
asking every member at once before the first step. An answer naming a slot the rank does not
hold is dropped and counted, never indexed."""

from __future__ import annotations

from control_standins import Plane, cluster_of, config

from elastic_ep.control.epochs import slot_check
from elastic_ep.control.epochs.slot_check import SlotSweeper
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import SlotChecksums, SweepSlots, rejected_counts


def test_members_are_asked_in_turn_over_the_interval(monkeypatch):
    ranks = {r: f"n{r // 4}" for r in range(8)}
    c = cluster_of(ranks, experts=8, slots=2, members=list(range(8)))
    c.location = ExpertLocation.from_phy2log([list(range(8)) * 2], 2, 8)  # 2 slots a rank, all occupied
    plane = Plane()
    sweeper = SlotSweeper(c, config(ep_size=8, expert_sweep_interval_s=1.0, expert_sweep_slots=1), plane, None)
    now = [100.0]
    monkeypatch.setattr(slot_check.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(slot_check, "MAX_GAP_S", 0.125)  # one member's worth, exact in binary
    sweeper.sweep()  # the first call, long after time 0: owes one member, not eight
    assert [r for r, _ in plane.to_workers] == [0]
    plane.to_workers.clear()
    now[0] += 30.0  # a stall: no call for 30 s
    sweeper.sweep()
    assert [r for r, _ in plane.to_workers] == [1]  # not all eight at once before the next step
    plane.to_workers.clear()
    asked = []
    for _ in range(8):  # eight calls over one interval: one member each
        now[0] += 0.125
        sweeper.sweep()
        asked.append([r for r, _ in plane.to_workers])
        plane.to_workers.clear()
    assert asked == [[(r + 2) % 8] for r in range(8)]
    for _ in range(8):
        now[0] += 0.125
        sweeper.sweep()
    second = [(r, m.slots) for r, m in plane.to_workers if isinstance(m, SweepSlots)]
    assert [r for r, _ in second] == [2, 3, 4, 5, 6, 7, 0, 1]
    # each its next slot in turn: the second of two for those asked twice, the first again for 0
    # and 1, asked a third time
    assert [slots for _, slots in second] == [[(0, 1)]] * 6 + [[(0, 0)]] * 2


def test_a_large_group_is_asked_less_often_for_more_slots_at_a_bounded_rate(monkeypatch):
    members = 4 * slot_check.MAX_REQUESTS_PER_S  # each member every 4 s, for 4 intervals' worth of slots
    ranks = {r: f"n{r // 8}" for r in range(members)}
    c = cluster_of(ranks, experts=members, slots=40, members=list(range(members)))
    c.location = ExpertLocation.from_phy2log([list(range(members)) * 40], 40, members)
    plane = Plane()
    sweeper = SlotSweeper(c, config(ep_size=members, expert_sweep_interval_s=1.0, expert_sweep_slots=4), plane, None)
    now = [100.0]
    monkeypatch.setattr(slot_check.time, "monotonic", lambda: now[0])
    sweeper.sweep()
    plane.to_workers.clear()
    for _ in range(40):  # 4 s in calls of 0.1 s
        now[0] += 0.1
        sweeper.sweep()
    asked = [(r, m.slots) for r, m in plane.to_workers if isinstance(m, SweepSlots)]
    assert abs(len(asked) - 4 * slot_check.MAX_REQUESTS_PER_S) <= 1  # the rate's, not one per member a second
    assert len({r for r, _ in asked}) == len(asked)  # each member once in its period
    assert {len(slots) for _, slots in asked} == {16}  # 4 slots a second, for 4 s


class References:
    """The changer's side of the check: expert e's reference checksum is 100 + e."""

    def __init__(self):
        self.suspect: set[tuple[int, int, int]] = set()

    def matches(self, layer: int, expert: int, checksum: int | None) -> bool:
        return checksum == 100 + expert

    def mark_suspect(self, slots: set[tuple[int, int, int]]) -> bool:
        new = slots - self.suspect
        self.suspect |= new
        return bool(new)


def test_an_answer_naming_a_slot_the_rank_does_not_hold_is_dropped_and_counted():
    c = cluster_of({0: "n0", 1: "n0"}, experts=4, slots=2, members=[0, 1])
    c.location = ExpertLocation.from_phy2log([[0, 1, 2, -1]], 2, 4)  # rank 1's second slot is empty
    refs = References()
    sweeper = SlotSweeper(c, config(ep_size=2), Plane(), refs)
    before = rejected_counts().get(("step", "n0", "invalid"), 0)
    for outside in ({(0, 2): 102}, {(1, 0): 100}, {(-1, 0): 100}, {(0, 1): 0}):  # past the slots, layers; empty
        sweeper.on_checksums(SlotChecksums(c.epoch, 1, outside))
    assert refs.suspect == set() and rejected_counts()[("step", "n0", "invalid")] == before + 4
    sweeper.on_checksums(SlotChecksums(c.epoch, 1, {(0, 0): 7}))  # a held slot with the wrong weights
    assert refs.suspect == {(1, 0, 0)}

