"""The epoch change against stand-in ranks (replies injected while it waits): a recovery fills
only the slots of the lost experts and checks only those; a filled slot with the wrong checksum
fails the epoch, and the slot it was copied from is suspect too; an epoch that does not form
leaves every slot it was to fill suspect, and the next epoch fills those again instead of
trusting them; a new leader's adoption epoch keeps the last leader's placement and fills nothing
on the ranks that hold it whole, and restores only the experts of a rank that does not."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from elastic_ep.control.cluster import ClusterState
from elastic_ep.control.config import ServeConfig
from elastic_ep.control.epochs.epoch_change import EpochChanger, Formed, NoPlacement, NotFormed, VerifyFailed
from elastic_ep.control.epochs.requests import Adopt, Recover, Rejoin, Reweight, Start
from elastic_ep.control.ranks import RankInfo, RankStatus
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import EpochFailed, EpochReady, EpochStart, HeldSlotMaps, SlotMapUnusable

CHECKSUM = {e: 100 + e for e in range(8)}  # the reference checksum of each expert (one layer)


class StandInRanks:
    """The plane the changer sends on, and the ranks' answers it receives while it pumps."""

    def __init__(self, failing: set[int] = frozenset(), wrong: set[int] = frozenset()):
        self.failing, self.wrong = failing, wrong
        self.starts: dict[int, EpochStart] = {}
        self.changer: EpochChanger | None = None
        self.held: dict[int, HeldSlotMaps] = defaultdict(HeldSlotMaps)  # each rank's maps, as a worker keeps them
        self.maps: dict[int, np.ndarray] = {}  # the map each rank rebuilt from its last EpochStart

    def messages_to_workers(self, messages: list[tuple[int, EpochStart]]) -> tuple[float, float, int]:
        self.starts.update(messages)
        return 0.0, 0.0, 0

    def set(self, key: str, value: str) -> None:  # the store
        pass

    def pump(self, timeout_s: float) -> None:
        for rank_id, start in self.starts.items():
            if rank_id in self.failing:
                self.changer.on_reply(EpochFailed(start.epoch, rank_id, "test failure"))
                continue
            try:
                self.maps[rank_id] = self.held[rank_id].resolve(start.slot_map)
            except SlotMapUnusable as e:
                self.changer.on_reply(EpochFailed(start.epoch, rank_id, str(e)))
                continue
            filled = {(s.layer, s.slot): CHECKSUM[s.expert] + (rank_id in self.wrong) for s in start.sources}
            self.changer.on_reply(EpochReady(start.epoch, rank_id, filled, {}, [], 0.0, 0.0, 0.0))
            self.held[rank_id].confirm(start.epoch, self.maps[rank_id])


def changer_with(ranks: StandInRanks) -> EpochChanger:
    cluster = ClusterState(num_layers=1, num_experts=4, slots_per_rank=2)
    for r in range(3):
        cluster.ranks[r] = RankInfo(r, "n0", status=RankStatus.SERVING)
    # rank 0 holds experts 0, 1; rank 1 holds 2, 3 (their only copies); rank 2 holds 0, 1
    cluster.location = ExpertLocation.from_phy2log([[0, 1, 2, 3, 0, 1]], 2, 4)
    cluster.members = [0, 1, 2]
    changer = EpochChanger(cluster, ServeConfig(model_dir="", model_name="", ep_size=3), ranks, ranks, 1,
                           ranks.pump, lambda ranks: False)
    changer.reference_checksums = {(0, e): c for e, c in CHECKSUM.items()}
    ranks.changer = changer
    return changer


def filled(ranks: StandInRanks) -> set[tuple[int, int, int]]:
    return {(r, s.layer, s.slot) for r, start in ranks.starts.items() for s in start.sources}


def test_a_recovery_fills_and_checks_only_the_lost_experts_slots():
    ranks = StandInRanks()
    changer = changer_with(ranks)
    outcome = changer.change(Recover([0, 2], [0, 2]), np.ones((1, 4)))  # rank 1 died with experts 2 and 3
    assert isinstance(outcome, Formed) and outcome.report.verified_slots == 2
    assert sorted(s.expert for start in ranks.starts.values() for s in start.sources) == [2, 3]
    assert sorted(changer.cluster.location.phy2log[0, :2].tolist() + changer.cluster.location.phy2log[0, 4:].tolist()) \
        == [0, 1, 2, 3]  # one copy each of 0 and 1 gave way


class LateRanks(StandInRanks):
    """Rank 0's answer comes only at the second pump; at the first, one of the epoch from rank 1,
    which the epoch left out (a reply of a rank the change did not ask)."""

    def __init__(self):
        super().__init__()
        self.pumps = 0

    def pump(self, timeout_s: float) -> None:
        self.pumps += 1
        epoch = next(iter(self.starts.values())).epoch
        self.changer.on_reply(EpochReady(epoch, 1, {}, {}, [], 0.0, 0.0, 0.0))
        if self.pumps == 1:
            self.starts, late = {r: s for r, s in self.starts.items() if r != 0}, self.starts
            super().pump(timeout_s)
            self.starts = late
        else:
            super().pump(timeout_s)


def test_only_the_replies_of_the_epochs_members_count():
    """A reply of the epoch being formed from a rank that is not one of its members does not stand
    in for a member's: the change waits for rank 0. It counted before, and the epoch formed
    without rank 0's answer (the warm-up then failed on it and stopped the control loop)."""
    ranks = LateRanks()
    changer = changer_with(ranks)
    outcome = changer.change(Recover([0, 2], [0, 2]), np.ones((1, 4)))
    assert isinstance(outcome, Formed) and ranks.pumps == 2 and sorted(changer.replies) == [0, 2]


def test_a_filled_slot_with_the_wrong_weights_fails_the_epoch():
    ranks = StandInRanks(wrong={2})
    outcome = changer_with(ranks).change(Recover([0, 2], [0, 2]), np.ones((1, 4)))
    assert isinstance(outcome, VerifyFailed) and {r for r, _, _ in outcome.bad} == {2}


def test_a_wrong_copy_makes_its_source_slot_suspect_too():
    ranks = StandInRanks(wrong={2})
    changer = changer_with(ranks)
    # rank 2's first slot takes expert 2 from rank 1's first slot
    outcome = changer.change(Reweight(ExpertLocation.from_phy2log([[0, 1, 2, 3, 2, 1]], 2, 4)), np.ones((1, 4)))
    assert isinstance(outcome, VerifyFailed) and outcome.bad == {(2, 0, 0)}
    assert changer.suspect_slots == {(2, 0, 0), (1, 0, 0)}


def test_slots_of_an_epoch_that_did_not_form_are_filled_again_by_the_next():
    ranks = StandInRanks(failing={2})
    changer = changer_with(ranks)
    outcome = changer.change(Recover([0, 2], [0, 2]), np.ones((1, 4)))
    assert isinstance(outcome, NotFormed)
    unknown = filled(ranks)
    assert changer.suspect_slots == unknown and changer.cluster.location.phy2log[0].tolist() == [0, 1, 2, 3, 0, 1]

    ranks.failing, ranks.starts = set(), {}
    outcome = changer.change(Recover([0, 2], [0, 2]), np.ones((1, 4)))
    assert isinstance(outcome, Formed) and unknown <= filled(ranks) and not changer.suspect_slots


def test_an_epoch_over_no_live_rank_is_no_placement_not_an_error():
    """Every rank of the first epoch faulted before it formed: the epoch asked for has no rank
    (it raised `max()` of an empty sequence) and the cluster degrades instead."""
    ranks = StandInRanks()
    changer = changer_with(ranks)
    changer.cluster.location, changer.cluster.members = None, []
    for request in (Start([]), Recover([], []), Rejoin([])):
        outcome = changer.change(request, np.ones((1, 4)))
        assert isinstance(outcome, NoPlacement) and "no live rank" in outcome.reason
    assert not ranks.starts and changer.cluster.epoch == -1  # no epoch was announced


def test_an_adoption_keeps_the_last_leaders_placement_and_fills_only_a_rank_that_does_not_hold_it():
    """A new leader knows nothing of the slots but the record's placement: on ranks that hold it whole
    nothing moves; a rank whose slots an unfinished epoch was changing counts as empty: the experts only
it held are restored as after its loss."""
    ranks = StandInRanks()
    changer = changer_with(ranks)
    record = changer.cluster.location
    changer.cluster.location, changer.cluster.members, changer.cluster.epoch = None, [], -1  # a fresh controller
    outcome = changer.change(Adopt([0, 1, 2], [0, 1, 2], record, after_epoch=5), np.ones((1, 4)))
    assert isinstance(outcome, Formed) and outcome.report.verified_slots == 0 and not filled(ranks)
    assert changer.cluster.epoch == 6 and ranks.starts[0].epoch == 6 and not ranks.starts[0].reuse_group
    assert changer.cluster.location.phy2log.tolist() == record.phy2log.tolist()

    ranks.starts = {}
    changer.cluster.location, changer.cluster.members = None, []
    outcome = changer.change(Adopt([0, 1, 2], [0, 2], record, after_epoch=6), np.ones((1, 4)))
    assert isinstance(outcome, Formed) and outcome.report.verified_slots == 2
    assert sorted(s.expert for start in ranks.starts.values() for s in start.sources) == [2, 3]  # rank 1's only



def wide_changer(ranks: StandInRanks) -> EpochChanger:
    """8 ranks of 2 slots over 8 experts (one layer), before their first epoch: a loss or a swap
    changes few enough slots that the changes are smaller than the map."""
    cluster = ClusterState(num_layers=1, num_experts=8, slots_per_rank=2)
    for r in range(8):
        cluster.ranks[r] = RankInfo(r, "n0", status=RankStatus.SERVING)
    changer = EpochChanger(cluster, ServeConfig(model_dir="", model_name="", ep_size=8), ranks, ranks, 1,
                           ranks.pump, lambda ranks: False)
    changer.reference_checksums = {(0, e): c for e, c in CHECKSUM.items()}
    ranks.changer = changer
    assert isinstance(changer.change(Start(list(range(8))), np.ones((1, 8))), Formed)
    assert all(start.slot_map.whole is not None for start in ranks.starts.values())
    ranks.starts = {}
    return changer


def swapped(location: ExpertLocation, a: int, b: int) -> ExpertLocation:
    """`location` with the experts of flat slots `a` and `b` swapped (two entries changed)."""
    phy2log = location.phy2log.copy()
    phy2log[0, [a, b]] = phy2log[0, [b, a]]
    return ExpertLocation.from_phy2log(phy2log, location.slots_per_rank, location.num_experts)


def test_an_epoch_sends_each_member_the_slots_changed_since_the_map_it_confirmed():
    """The first epoch sends the whole map; the next sends the ranks that confirmed it only the
    changed slots, and each rebuilds exactly the new map. A rank that failed an epoch, and a new
    process under a rank id (a new record), get the whole map again."""
    ranks = StandInRanks()
    changer = wide_changer(ranks)
    live = [0, 1, 2, 4, 5, 6, 7]
    assert isinstance(changer.change(Recover(live, live), np.ones((1, 8))), Formed)  # rank 3 died
    assert all(start.slot_map.delta is not None and start.slot_map.whole is None for start in ranks.starts.values())
    assert all(ranks.maps[r].tolist() == changer.cluster.location.phy2log.tolist() for r in live)

    ranks.starts, ranks.failing = {}, {2}
    assert isinstance(changer.change(Reweight(swapped(changer.cluster.location, 0, 15)), np.ones((1, 8))), NotFormed)
    ranks.starts, ranks.failing = {}, set()
    changer.cluster.ranks[0] = RankInfo(0, "n0", status=RankStatus.SERVING)  # rank 0 came back: a new process
    ranks.held[0] = HeldSlotMaps()
    target = swapped(changer.cluster.location, 1, 14)
    assert isinstance(changer.change(Reweight(target), np.ones((1, 8))), Formed)
    assert ranks.starts[0].slot_map.whole is not None and ranks.starts[2].slot_map.whole is not None
    assert ranks.starts[1].slot_map.delta is not None  # it confirmed the map of the epoch that did not form
    assert all(ranks.maps[r].tolist() == target.phy2log.tolist() for r in live)


def test_a_rank_that_cannot_rebuild_its_map_fails_the_epoch_and_gets_it_whole_next():
    """A rank that lost the map its delta names (here: its held maps dropped) answers EpochFailed
    naming the epoch; the retry sends it the whole map and forms."""
    ranks = StandInRanks()
    changer = wide_changer(ranks)
    ranks.held[1] = HeldSlotMaps()
    target = swapped(changer.cluster.location, 0, 15)
    outcome = changer.change(Reweight(target), np.ones((1, 8)))
    assert isinstance(outcome, NotFormed) and "rank 1" in outcome.detail and "does not hold" in outcome.detail
    ranks.starts = {}
    assert isinstance(changer.change(Reweight(target), np.ones((1, 8))), Formed)
    assert ranks.starts[1].slot_map.whole is not None and ranks.starts[0].slot_map.delta is not None
    assert all(ranks.maps[r].tolist() == target.phy2log.tolist() for r in range(8))
