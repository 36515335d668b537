"""The expert location maps: which logical expert sits in which physical slot of which rank.

Slot `r * slots_per_rank + j` is slot j of rank r, counted over every rank of the deployment,
dead ones included, so two placements of the same deployment compare slot by slot. A dead or
removed rank keeps its slots in the maps, empty (-1).

Arrays are numpy int64 and read-only; a runtime that wants torch tensors wraps them with
`torch.from_numpy` (no copy).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elastic_ep.errors import PlacementError

EMPTY = -1


def _readonly(a: np.ndarray) -> np.ndarray:
    if (isinstance(a, np.ndarray) and a.dtype == np.int64 and a.flags.c_contiguous and a.flags.owndata
            and not a.flags.writeable):
        return a  # read-only and not a view (built here, or another placement's): nobody can change it
    a = np.array(a, dtype=np.int64, order="C")  # a copy: the caller's array stays writable
    a.setflags(write=False)
    return a


def count_replicas(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """logcnt [L, E]: the slots of phy2log [L, S_total] holding each expert (-1 slots not counted)."""
    num_layers = phy2log.shape[0]
    key = np.where(phy2log < 0, num_experts, phy2log)
    flat = (np.arange(num_layers)[:, None] * (num_experts + 1) + key).ravel()
    counts = np.bincount(flat, minlength=num_layers * (num_experts + 1)).reshape(num_layers, num_experts + 1)
    return counts[:, :num_experts]


def build_log2phy(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Invert a slot map.

    phy2log: [L, S_total], logical expert per slot, -1 for an empty slot.
    Returns (log2phy [L, E, R] with the slots of each expert in ascending order, -1 padded,
    R = max(1, max replicas); logcnt [L, E]).
    """
    num_layers, num_slots = phy2log.shape
    key = np.where(phy2log < 0, num_experts, phy2log)
    logcnt = count_replicas(phy2log, num_experts)
    max_replicas = max(1, int(logcnt.max(initial=0)))
    order = np.argsort(key, axis=1, kind="stable")
    sorted_key = np.take_along_axis(key, order, axis=1)
    counts = np.concatenate([logcnt, np.zeros((num_layers, 1), dtype=logcnt.dtype)], axis=1)  # [L, E + 1]
    group_start = np.cumsum(counts, axis=1) - counts
    replica = np.arange(num_slots)[None, :] - np.take_along_axis(group_start, sorted_key, axis=1)
    # [L, E, R] itself, not a slice of [L, E + 1, R]: at 1,024 ranks a hot expert has over a hundred
    # replicas, log2phy is ~15 MB, and a slice would be copied again to be contiguous
    log2phy = np.full((num_layers, num_experts, max_replicas), EMPTY, dtype=np.int64)
    layer = np.broadcast_to(np.arange(num_layers)[:, None], order.shape)
    used = sorted_key < num_experts
    log2phy[layer[used], sorted_key[used], replica[used]] = order[used]
    return log2phy, logcnt


@dataclass(frozen=True, eq=False)
class ExpertLocation:
    """A placement of L layers of E logical experts over `num_ranks` ranks of `slots_per_rank` slots.

    phy2log: [L, num_ranks * slots_per_rank], logical expert per slot, -1 = empty.
    logcnt:  [L, E], number of replicas of each expert.
    log2phy: [L, E, R], the slots holding each expert (ascending), -1 padded: built from phy2log
        the first time it is read, then kept. It is padded to the most replicated expert's copies
        (up to one per rank: ~120 MB at 1,024 ranks), and only a worker's token routing reads
        it; the controller's recovery, transfer plan, snapshot and wire use phy2log and logcnt.
    """

    phy2log: np.ndarray
    logcnt: np.ndarray
    slots_per_rank: int
    num_ranks: int

    def __post_init__(self) -> None:
        for name in ("phy2log", "logcnt"):
            object.__setattr__(self, name, _readonly(getattr(self, name)))

    @functools.cached_property
    def log2phy(self) -> np.ndarray:
        """[L, E, R] (see the class): a function of phy2log, built once on first read."""
        log2phy, _ = build_log2phy(self.phy2log, self.num_experts)
        log2phy.setflags(write=False)
        return log2phy

    @classmethod
    def from_phy2log(cls, phy2log, slots_per_rank: int, num_experts: int) -> ExpertLocation:
        """Build the maps from a slot map. phy2log: [L, num_ranks * slots_per_rank] (array-like)."""
        p = np.asarray(phy2log, dtype=np.int64)
        if p.ndim != 2:
            raise PlacementError(f"phy2log must be 2-D [layers, slots], got shape {list(p.shape)}")
        if slots_per_rank < 1 or p.shape[1] % slots_per_rank:
            raise PlacementError(
                f"phy2log has {p.shape[1]} slots per layer, not a multiple of slots_per_rank={slots_per_rank}"
            )
        bad = (p < EMPTY) | (p >= num_experts)
        if bad.any():
            layer, slot = (int(i[0]) for i in np.nonzero(bad))
            raise PlacementError(
                f"phy2log[{layer}][{slot}] = {int(p[layer, slot])} is not an expert id in [0, {num_experts}) or -1"
            )
        logcnt = count_replicas(p, num_experts)
        logcnt.setflags(write=False)  # a new array: read-only as it is, not copied (`_readonly`)
        return cls(p, logcnt, slots_per_rank, p.shape[1] // slots_per_rank)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    @property
    def num_slots(self) -> int:
        return self.num_ranks * self.slots_per_rank

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def slots_of_rank(self, rank: int) -> range:
        """The global slot indices of `rank`."""
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def experts_of_rank(self, rank: int) -> np.ndarray:
        """[L, slots_per_rank]: the logical expert in each slot of `rank`, -1 = empty."""
        return self.phy2log[:, rank * self.slots_per_rank : (rank + 1) * self.slots_per_rank]

    def by_rank(self) -> np.ndarray:
        """[L, num_ranks, slots_per_rank] view of phy2log."""
        return self.phy2log.reshape(self.num_layers, self.num_ranks, self.slots_per_rank)

    def restricted_to(self, live_ranks: Iterable[int]) -> ExpertLocation:
        """This placement with the slots of ranks outside `live_ranks` emptied: what still serves
        right after a failure, before any re-placement (check it with `validate(live_ranks)`)."""
        by_rank = self.by_rank().copy()
        by_rank[:, ~self._live_mask(live_ranks)] = EMPTY
        return ExpertLocation.from_phy2log(by_rank.reshape(self.num_layers, -1), self.slots_per_rank, self.num_experts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertLocation):
            return NotImplemented
        return (
            self.slots_per_rank == other.slots_per_rank
            and self.num_ranks == other.num_ranks
            and np.array_equal(self.phy2log, other.phy2log)
            and np.array_equal(self.logcnt, other.logcnt)
        )

    __hash__ = None  # type: ignore[assignment]

    def validate(self, live_ranks: Iterable[int] | None = None) -> None:
        """Raise PlacementError unless this placement can serve on `live_ranks` (default: all ranks).

        Checks: the shapes agree; log2phy and logcnt are the inverse of phy2log; no expert sits
        twice on one rank; the slots of ranks outside `live_ranks` are empty (tokens must never be
        routed to them); every logical expert has at least one replica.
        """
        self.check_maps()
        by_rank = self.by_rank()
        ordered = np.sort(by_rank, axis=2)
        twice = (ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, 1:] >= 0)
        if twice.any():
            layer, rank, j = (int(i[0]) for i in np.nonzero(twice))
            raise PlacementError(
                f"layer {layer}: expert {int(ordered[layer, rank, j])} sits twice on rank {rank}; "
                "a second copy on one rank adds memory and no balance"
            )
        live = self._live_mask(live_ranks)
        occupied_dead = (by_rank >= 0) & ~live[None, :, None]
        if occupied_dead.any():
            layer, rank, _ = (int(i[0]) for i in np.nonzero(occupied_dead))
            raise PlacementError(
                f"layer {layer}: rank {rank} is not live but holds experts; re-place over the live ranks"
            )
        missing = self.logcnt == 0
        if missing.any():
            layer, expert = (int(i[0]) for i in np.nonzero(missing))
            raise PlacementError(
                f"layer {layer}: expert {expert} has no live replica ({int(missing.sum())} (layer, expert) pairs "
                "in all); re-place over the live ranks or restore it from backup"
            )

    def check_maps(self) -> None:
        """Raise PlacementError unless the shapes agree and logcnt counts phy2log's replicas
        (log2phy is built from phy2log, so it cannot disagree)."""
        num_layers, num_slots = self.phy2log.shape
        if num_slots != self.num_ranks * self.slots_per_rank:
            raise PlacementError(
                f"phy2log has {num_slots} slots per layer but num_ranks * slots_per_rank = "
                f"{self.num_ranks} * {self.slots_per_rank} = {self.num_ranks * self.slots_per_rank}"
            )
        if self.logcnt.ndim != 2 or self.logcnt.shape[0] != num_layers:
            raise PlacementError(f"logcnt must be [L={num_layers}, E], got {list(self.logcnt.shape)}")
        expected = count_replicas(self.phy2log, self.num_experts)
        if not np.array_equal(expected, self.logcnt):
            layer, expert = (int(i[0]) for i in np.nonzero(expected != self.logcnt))
            raise PlacementError(
                f"logcnt[{layer}][{expert}] = {int(self.logcnt[layer, expert])} but phy2log holds "
                f"{int(expected[layer, expert])} replicas of that expert"
            )

    def _live_mask(self, live_ranks: Iterable[int] | None) -> np.ndarray:
        if live_ranks is None:
            return np.ones(self.num_ranks, dtype=bool)
        live = np.zeros(self.num_ranks, dtype=bool)
        for r in live_ranks:
            if not 0 <= r < self.num_ranks:
                raise PlacementError(f"live rank {r} is outside the placement's ranks 0..{self.num_ranks - 1}")
            live[r] = True
        return live

    def slot_map_dict(self) -> dict:
        """phy2log and logcnt as nested lists, plus the slot geometry: everything `from_json` needs,
        of a size set by the slots. log2phy is left out: `[L, E, R]` padded to the hottest expert's
        number of replicas R (up to one per rank), and `from_phy2log` rebuilds it."""
        return {
            "num_ranks": self.num_ranks,
            "slots_per_rank": self.slots_per_rank,
            "num_experts": self.num_experts,
            "phy2log": self.phy2log.tolist(),
            "logcnt": self.logcnt.tolist(),
        }

    def to_dict(self) -> dict:
        """The placement file's content: `slot_map_dict` and log2phy as nested lists."""
        return {**self.slot_map_dict(), "log2phy": self.log2phy.tolist()}

    def to_json(self) -> str:
        """The placement file (`to_dict` as JSON)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> ExpertLocation:
        """Parse `to_json` output; raises PlacementError naming what is missing or inconsistent."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlacementError(f"placement is not valid JSON: {e}") from e
        if not isinstance(data, dict) or "phy2log" not in data or "slots_per_rank" not in data:
            raise PlacementError("a placement file needs at least 'phy2log' and 'slots_per_rank'")
        try:
            phy2log = np.asarray(data["phy2log"])
        except ValueError:
            phy2log = np.zeros(0)
        if phy2log.ndim != 2 or not np.issubdtype(phy2log.dtype, np.integer):
            raise PlacementError("'phy2log' must be a [layers][slots] list of integers")
        if "num_experts" in data:
            num_experts = int(data["num_experts"])
        elif data.get("logcnt"):
            num_experts = len(data["logcnt"][0])
        else:
            num_experts = int(phy2log.max()) + 1
        loc = cls.from_phy2log(phy2log, int(data["slots_per_rank"]), num_experts)
        if "num_ranks" in data and int(data["num_ranks"]) != loc.num_ranks:
            raise PlacementError(
                f"num_ranks={data['num_ranks']} but phy2log has {phy2log.shape[1]} slots = "
                f"{loc.num_ranks} ranks of {loc.slots_per_rank}"
            )
        try:
            logcnt = np.asarray(data.get("logcnt", loc.logcnt), dtype=np.int64)
            log2phy = np.asarray(data["log2phy"], dtype=np.int64) if "log2phy" in data else None
        except (ValueError, TypeError) as e:
            raise PlacementError(f"'log2phy' and 'logcnt' must be rectangular lists of integers: {e}") from e
        ExpertLocation(loc.phy2log, logcnt, loc.slots_per_rank, loc.num_ranks).check_maps()
        if log2phy is not None:
            _check_log2phy(log2phy, loc)
        return loc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> ExpertLocation:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlacementError(f"cannot read placement file {path}: {e.strerror}") from e
        return cls.from_json(text)


def _check_log2phy(log2phy: np.ndarray, loc: ExpertLocation) -> None:
    """Raise PlacementError unless a placement file's log2phy [L, E, R'] lists the slots of
    `loc.phy2log` for each expert (in any order, -1 padded to any R' >= loc's R)."""
    built = loc.log2phy
    if log2phy.ndim != 3 or log2phy.shape[:2] != built.shape[:2]:
        raise PlacementError(f"log2phy must be [L, E, R] with [L, E] = {list(built.shape[:2])}, "
                             f"got {list(log2phy.shape)}")
    width = built.shape[2]
    if log2phy.shape[2] < width or (log2phy[:, :, width:] >= 0).any():
        raise PlacementError(f"log2phy has room for {log2phy.shape[2]} replicas, phy2log holds up to {width}")
    if not np.array_equal(np.sort(built, axis=2), np.sort(log2phy[:, :, :width], axis=2)):
        raise PlacementError("log2phy does not list the slots phy2log gives each expert; rebuild it with from_phy2log")
