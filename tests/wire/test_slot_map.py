"""The slot map on the wire (wire/slot_map.py): the changes since a confirmed map rebuild the new
map exactly and are a small part of it; a delta whose base the rank does not hold, that rebuilds
another map than its digest names, or that is malformed is refused with a message, never applied
and never an IndexError; a rank keeps its last two confirmed maps."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_ep.wire import (
    CONTROLLER_TO_WORKER,
    ClusterKey,
    EpochStart,
    HeldSlotMaps,
    Inbox,
    Membership,
    SharedSlotMaps,
    SlotMap,
    SlotMapDelta,
    SlotMapUnusable,
    encode,
    slot_map_delta,
    slot_map_for_wire,
)

KEY = ClusterKey.generate()


def deepseek_map(num_ranks: int = 1024, slots: int = 3, seed: int = 0) -> np.ndarray:
    """[58, num_ranks * slots] expert ids of DeepSeek-V3's 58 x 256 experts, in the wire dtype."""
    rng = np.random.default_rng(seed)
    return slot_map_for_wire(rng.integers(0, 256, (58, num_ranks * slots)), 256)


def moved(base: np.ndarray, count: int, seed: int = 1) -> np.ndarray:
    """`base` with `count` entries set to another expert."""
    rng = np.random.default_rng(seed)
    new = base.copy()
    flat = rng.choice(base.size, count, replace=False)
    new.reshape(-1)[flat] = (new.reshape(-1)[flat] + 1) % 256
    return new


def test_a_recoverys_changes_travel_instead_of_the_map_and_rebuild_it_exactly():
    base = deepseek_map()
    new = moved(base, 300)  # a lost rank's experts filled elsewhere, its own slots emptied
    delta = slot_map_delta(base, new, base_epoch=7)
    assert delta is not None and delta.index.size == 300
    whole = EpochStart(8, Membership.of([0]), SlotMap.of(new), 3, [], [], {}, 30.0, 10.0)
    changes = EpochStart(8, Membership.of([0]), SlotMap(whole.slot_map.shape, whole.slot_map.digest, delta=delta), 3,
                         [], [], {}, 30.0, 10.0)
    assert len(encode(changes)) * 100 < len(encode(whole))  # ~1.8 KB against ~356 KB
    held = HeldSlotMaps()
    held.confirm(7, base)
    got = Inbox("t_worker", CONTROLLER_TO_WORKER, KEY).read(KEY.seal(changes))
    rebuilt = held.resolve(got.slot_map)
    assert rebuilt.dtype == np.int16 and np.array_equal(rebuilt, new)
    assert np.array_equal(held.resolve(whole.slot_map), new)


def test_the_whole_map_is_sent_where_the_changes_are_not_smaller():
    base = deepseek_map(num_ranks=8)
    assert slot_map_delta(base, moved(base, base.size // 3), 1) is None
    assert slot_map_delta(base, moved(base, base.size // 3 - 1), 1) is not None
    assert slot_map_delta(base, deepseek_map(num_ranks=9), 1) is None  # a rank more: another shape
    assert slot_map_delta(base, base.astype(np.int32), 1) is None


def test_a_delta_against_a_map_the_rank_does_not_hold_is_refused_naming_the_epoch():
    base = deepseek_map(num_ranks=8)
    new = moved(base, 10)
    slot_map = SlotMap(new.shape, SlotMap.of(new).digest, delta=slot_map_delta(base, new, 3))
    held = HeldSlotMaps()
    with pytest.raises(SlotMapUnusable, match="since epoch 3, whose map this rank does not hold"):
        held.resolve(slot_map)
    held.confirm(3, moved(base, 1, seed=5))  # a map of epoch 3 other than the controller's
    with pytest.raises(SlotMapUnusable, match="rebuilt .* does not match"):
        held.resolve(slot_map)


@pytest.mark.parametrize("delta, problem", [
    (SlotMapDelta(3, np.array([0, 10 ** 6], dtype=np.int32), np.array([1, 2], dtype=np.int16)), "outside the map"),
    (SlotMapDelta(3, np.array([-1], dtype=np.int32), np.array([1], dtype=np.int16)), "outside the map"),
    (SlotMapDelta(3, np.array([0, 1], dtype=np.int32), np.array([1], dtype=np.int16)), "as many"),
    (SlotMapDelta(3, np.array([0.5]), np.array([1], dtype=np.int16)), "integer"),
    (SlotMapDelta(3, np.array([0], dtype=np.int32), np.array([1], dtype=np.int64)), "as many int16"),
])
def test_a_malformed_delta_is_refused_not_applied(delta, problem):
    base = deepseek_map(num_ranks=8)
    held = HeldSlotMaps()
    held.confirm(3, base)
    sent = Inbox("t_worker", CONTROLLER_TO_WORKER, KEY).read(KEY.seal(
        EpochStart(4, Membership.of([0]), SlotMap(base.shape, 0, delta=delta), 3, [], [], {}, 30.0, 10.0)))
    with pytest.raises(SlotMapUnusable, match=problem):
        held.resolve(sent.slot_map)
    assert np.array_equal(held.resolve(SlotMap.of(base)), base)  # the held map is as it was
    with pytest.raises(SlotMapUnusable, match="exactly one"):
        held.resolve(SlotMap(base.shape, 0))


def test_a_rank_keeps_the_last_two_maps_it_confirmed():
    maps = [deepseek_map(num_ranks=8, seed=s) for s in range(3)]
    held = HeldSlotMaps()
    for epoch, m in enumerate(maps):
        held.confirm(epoch, m)
    new = moved(maps[2], 5)
    for base_epoch in (1, 2):
        slot_map = SlotMap(new.shape, SlotMap.of(new).digest, delta=SlotMapDelta(
            base_epoch, np.flatnonzero(maps[base_epoch] != new).astype(np.int32),
            new.reshape(-1)[maps[base_epoch].reshape(-1) != new.reshape(-1)]))
        assert np.array_equal(held.resolve(slot_map), new)
    with pytest.raises(SlotMapUnusable, match="holds epochs \\[1, 2\\]"):
        held.resolve(SlotMap(new.shape, 0, delta=SlotMapDelta(0, np.zeros(0, np.int32), np.zeros(0, np.int16))))


def test_the_ranks_of_one_stand_in_process_share_the_maps_they_rebuild():
    """Ranks sharing `SharedSlotMaps` hold one array per map: the second rank sent the same whole
    map, or the same changes against the very array the first holds, gets the first's result;
    a rank whose base is another array rebuilds its own, and a missing base is refused as alone."""
    shared = SharedSlotMaps()
    first, second, other, empty = (HeldSlotMaps(shared) for _ in range(4))
    base = deepseek_map(num_ranks=8)
    for held in (first, second):
        held.confirm(1, held.resolve(SlotMap.of(base.copy())))
    other.confirm(1, base.copy())
    new = moved(base, 10)
    slot_map = SlotMap(new.shape, SlotMap.of(new).digest, delta=slot_map_delta(base, new, 1))
    got = [held.resolve(slot_map) for held in (first, second, other)]
    assert got[0] is got[1] and got[2] is not got[0] and all(np.array_equal(g, new) for g in got)
    assert not got[0].flags.writeable  # no rank can change what the others route by
    with pytest.raises(SlotMapUnusable, match="does not hold"):
        empty.resolve(slot_map)
