import numpy as np
import pytest

from elastic_ep.errors import PlacementError
from elastic_ep.placement import ExpertLocation


def _two_ranks() -> ExpertLocation:
    # rank 0 holds experts 0, 1; rank 1 holds 2, 0 (expert 0 has two replicas)
    return ExpertLocation.from_phy2log([[0, 1, 2, 0]], slots_per_rank=2, num_experts=3)


def test_maps_are_inverse_of_slot_map():
    loc = _two_ranks()
    assert loc.num_ranks == 2 and loc.num_layers == 1 and loc.num_experts == 3
    assert loc.logcnt.tolist() == [[2, 1, 1]]
    assert loc.log2phy.tolist() == [[[0, 3], [1, -1], [2, -1]]]
    assert list(loc.slots_of_rank(1)) == [2, 3]
    assert loc.experts_of_rank(1).tolist() == [[2, 0]]
    loc.validate()


def test_json_round_trip_keeps_every_map():
    loc = _two_ranks()
    again = ExpertLocation.from_json(loc.to_json())
    assert again == loc
    assert np.array_equal(again.log2phy, loc.log2phy)


def test_arrays_cannot_be_changed_in_place():
    with pytest.raises(ValueError):
        _two_ranks().phy2log[0, 0] = 2


def test_dead_rank_holding_experts_is_rejected():
    with pytest.raises(PlacementError, match="rank 1 is not live"):
        _two_ranks().validate(live_ranks=[0])


def test_expert_without_replica_is_named():
    loc = ExpertLocation.from_phy2log([[0, 1, -1, -1]], slots_per_rank=2, num_experts=3)
    with pytest.raises(PlacementError, match="expert 2 has no live replica"):
        loc.validate()


def test_expert_twice_on_one_rank_is_rejected():
    loc = ExpertLocation.from_phy2log([[0, 0, 1, 2]], slots_per_rank=2, num_experts=3)
    with pytest.raises(PlacementError, match="expert 0 sits twice on rank 0"):
        loc.validate()


def test_inconsistent_maps_are_rejected():
    loc = _two_ranks()
    bad = ExpertLocation(loc.phy2log, np.array([[1, 1, 1]]), 2, 2)
    with pytest.raises(PlacementError, match="logcnt"):
        bad.validate()
    with pytest.raises(PlacementError, match="slots per layer"):
        ExpertLocation(loc.phy2log, loc.logcnt, 2, 3).validate()


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ('{"phy2log": [[0, 1]]}', "slots_per_rank"),
        ('{"phy2log": [[0, 1, 2]], "slots_per_rank": 2}', "not a multiple"),
        ('{"phy2log": [[0, 5]], "slots_per_rank": 1, "num_experts": 2}', "not an expert id"),
        ('{"phy2log": [[0, 1]], "slots_per_rank": 1, "logcnt": [[2, 1]]}', "logcnt"),
        ('{"phy2log": [[0], [1, 2]], "slots_per_rank": 1}', "phy2log"),
        ('{"phy2log": [[0, 1]], "slots_per_rank": 1, "log2phy": [[[1], [0]]]}', "does not list the slots"),
        ('{"phy2log": [[0, 0]], "slots_per_rank": 1, "num_experts": 2, "log2phy": [[[0], [-1]]]}', "room for 1"),
        ('{"phy2log": [[0, 1]], "slots_per_rank": 1, "log2phy": [[0, 1]]}', r"log2phy must be \[L, E, R\]"),
    ],
)
def test_bad_placement_files_name_the_problem(text, message):
    with pytest.raises(PlacementError, match=message):
        ExpertLocation.from_json(text)


def test_restricting_to_live_ranks_keeps_the_surviving_replicas():
    survivors = _two_ranks().restricted_to([1])
    assert survivors.phy2log.tolist() == [[-1, -1, 2, 0]]
    assert survivors.logcnt.tolist() == [[1, 0, 1]]
    with pytest.raises(PlacementError, match="expert 1 has no live replica"):
        survivors.validate([1])


def test_a_built_map_is_not_copied_and_a_callers_array_is():
    """The maps built from a slot map are kept as built (a recovery at 1,024 ranks builds several
    placements); an array the caller can still write, or a read-only view of one, is copied, so
    changing it changes no placement."""
    phy2log = np.array([[0, 1, 2, 0, 1, 3]])
    loc = ExpertLocation.from_phy2log(phy2log, 3, 4)
    again = ExpertLocation(loc.phy2log, loc.logcnt, 3, 2)
    assert again.phy2log is loc.phy2log and again.logcnt is loc.logcnt
    assert loc.log2phy is loc.log2phy and not loc.log2phy.flags.writeable  # built once, read-only
    phy2log[0, 0] = 3
    assert loc.phy2log[0, 0] == 0
    view = phy2log[:, :]
    view.setflags(write=False)
    kept = ExpertLocation.from_phy2log(view, 3, 4)
    phy2log[0, 1] = 2
    assert kept.phy2log[0, 1] == 1
