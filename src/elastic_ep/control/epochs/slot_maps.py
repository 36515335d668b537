"""Which placement map each rank confirmed, so that an epoch sends each member only what changed.

A rank's `EpochReady` confirms the slot map of that epoch (wire/slot_map.py): the rank holds it
from then on, whatever becomes of the epoch. The next `EpochStart` gives that rank the map as the
changes since it; a rank that confirmed none (a new process: a new `RankInfo.record`), or whose
last answer was `EpochFailed` (it may hold another map than the one counted, or none), gets the
whole map. The maps are kept by epoch while some rank's confirmation names them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from elastic_ep.wire import SlotMap, slot_map_delta


class ConfirmedSlotMaps:
    """rank_id -> (record, epoch) of the map it confirmed, and those maps (wire dtype) by epoch."""

    def __init__(self) -> None:
        self._by_rank: dict[int, tuple[int, int]] = {}
        self._maps: dict[int, np.ndarray] = {}

    def confirmed(self, rank_id: int, record: int, epoch: int) -> None:
        """Rank `rank_id` (its record `record`) answered `EpochReady` for `epoch`."""
        if epoch in self._maps:
            self._by_rank[rank_id] = (record, epoch)

    def failed(self, rank_id: int) -> None:
        """Rank `rank_id` answered `EpochFailed`: the whole map next time."""
        self._by_rank.pop(rank_id, None)

    def forms(self, epoch: int, new: np.ndarray, members: Iterable[int], records: Mapping[int, int]) -> dict[
            int, SlotMap]:
        """The `SlotMap` of `new` [L, S] (wire dtype), the map of `epoch` now being sent, for each of
        `members` (`records`: each one's current `RankInfo.record`). Members that confirmed the same
        map share one object, so the plane seals it once. `new` is kept for the members' answers;
        maps no member's confirmation names any more are dropped."""
        self._maps[epoch] = new
        whole = SlotMap.of(new)
        by_base: dict[int, SlotMap] = {}
        forms = {}
        for r in members:
            record, base = self._by_rank.get(r, (None, None))
            if base is None or record != records.get(r):
                forms[r] = whole
                continue
            form = by_base.get(base)
            if form is None:
                delta = slot_map_delta(self._maps[base], new, base)
                form = by_base[base] = whole if delta is None else SlotMap(whole.shape, whole.digest, delta=delta)
            forms[r] = form
        kept = {base for _, base in self._by_rank.values()} | {epoch}
        self._maps = {e: m for e, m in self._maps.items() if e in kept}
        return forms
