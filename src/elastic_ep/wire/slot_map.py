"""The placement's slot map (`phy2log` [L, num_ranks * slots_per_rank], expert ids, -1 empty) as
an `EpochStart` carries it: whole, or as the slots that changed since a map the rank confirmed.

Every member needs the whole map (its dispatch routes by `log2phy`, built from it), but a recovery
changes the slots of one rank's experts: a few hundred entries of ~0.25 M at 1,024 ranks of
DeepSeek-V3's 58 x 256 experts. The controller sends each rank the changes against the last map
that rank confirmed with `EpochReady` (control/epochs/slot_maps.py), and the whole map only to a
rank that confirmed none, a map of another shape, or where the changes are not smaller. The rank
keeps the maps it confirmed last (`HeldSlotMaps`), rebuilds the new one, and checks it against
the digest of the whole map before it uses it: a rank never routes by a map it rebuilt wrong."""

from __future__ import annotations

import zlib

import numpy as np

from .codec import Record, narrow_int


class SlotMapDelta(Record):
    """The entries of the new map that differ from the map of `base_epoch`: `index` [n] (int32,
    flat positions in [L, S]: layer * S + slot) now hold `experts` [n] (the map's dtype)."""

    base_epoch: int
    index: np.ndarray
    experts: np.ndarray


class SlotMap(Record):
    """A slot map of `shape` [L, S] whose bytes (in the wire dtype) have CRC-32 `digest`: `whole`,
    or `delta` against a map the receiving rank confirmed. Exactly one of the two is set."""

    shape: tuple[int, int]
    digest: int
    whole: np.ndarray | None = None
    delta: SlotMapDelta | None = None

    @classmethod
    def of(cls, phy2log: np.ndarray) -> SlotMap:
        """The whole map `phy2log` [L, S] (already in its wire dtype: `slot_map_for_wire`)."""
        return cls((int(phy2log.shape[0]), int(phy2log.shape[1])), slot_map_digest(phy2log), whole=phy2log)


class SlotMapUnusable(ValueError):
    """A `SlotMap` this rank cannot turn into the map it describes; the message says why. The
    rank answers `EpochFailed`, and the controller sends it the whole map next time."""


def slot_map_for_wire(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """`phy2log` [L, slots] (expert ids, -1 empty) as int16 when the ids fit, else int32."""
    return np.asarray(phy2log, dtype=narrow_int(num_experts))


def slot_map_digest(phy2log: np.ndarray) -> int:
    """CRC-32 of the map's bytes, row-major, in its own dtype."""
    return zlib.crc32(np.ascontiguousarray(phy2log).data)


def slot_map_delta(base: np.ndarray, new: np.ndarray, base_epoch: int) -> SlotMapDelta | None:
    """The changes that turn `base` [L, S] into `new` [L, S], or None where sending them is no
    cheaper than `new` whole: another shape or dtype, or a third or more of the entries changed
    (an entry of the delta is 4 bytes of index and one of the map's)."""
    if base.shape != new.shape or base.dtype != new.dtype:
        return None
    index = np.flatnonzero(base != new).astype(np.int32)
    if 3 * index.size >= new.size:
        return None
    return SlotMapDelta(base_epoch, index, new.reshape(-1)[index])


def apply_slot_map_delta(base: np.ndarray, delta: SlotMapDelta) -> np.ndarray:
    """A copy of `base` [L, S] with `delta`'s entries written. Raises SlotMapUnusable on an index
    that is not an integer inside the map, or experts of another dtype or count."""
    if delta.index.dtype.kind not in "iu":
        raise SlotMapUnusable(f"a slot map delta's index must be integer, got {delta.index.dtype}")
    if delta.index.shape != delta.experts.shape or delta.index.ndim != 1 or delta.experts.dtype != base.dtype:
        raise SlotMapUnusable(f"a slot map delta needs as many {base.dtype} experts as indices, got "
                              f"{delta.experts.dtype} {delta.experts.shape} for {delta.index.shape}")
    if delta.index.size and (int(delta.index.min()) < 0 or int(delta.index.max()) >= base.size):
        raise SlotMapUnusable(f"a slot map delta's index is outside the map of {base.size} slots")
    new = base.copy()
    new.reshape(-1)[delta.index] = delta.experts
    return new


class SharedSlotMaps:
    """The maps the ranks of one process resolved last, for the stand-in harness, which runs
    hundreds of ranks in a process: a rank sent the same map whole, or the same changes against
    the very array another rank holds as its base, takes that rank's result instead of a copy of
    its own (at 1,024 ranks a map is ~0.36 MB, its copy ~0.35 ms: a real rank makes it alongside
    the others, a stand-in process would make them one after another). A worker keeps none."""

    LIMIT = 8

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[np.ndarray | None, np.ndarray]] = {}  # (id(base), digest)

    def get(self, base: np.ndarray | None, digest: int) -> np.ndarray | None:
        hit = self._maps.get((id(base), digest))
        return hit[1] if hit is not None and hit[0] is base else None

    def put(self, base: np.ndarray | None, digest: int, phy2log: np.ndarray) -> None:
        phy2log.setflags(write=False)  # shared by every rank of the process that resolves it
        self._maps[(id(base), digest)] = (base, phy2log)
        while len(self._maps) > self.LIMIT:
            del self._maps[next(iter(self._maps))]


class HeldSlotMaps:
    """The slot maps one rank confirmed last (its `EpochReady`), by epoch: the bases a `SlotMap`'s
    delta may name. Two are kept: the controller may not have counted the newest (an answer of an
    epoch it had already given up), and then names the one before. `shared`: the stand-in
    harness's maps of the process (`SharedSlotMaps`)."""

    KEEP = 2

    def __init__(self, shared: SharedSlotMaps | None = None) -> None:
        self._maps: dict[int, np.ndarray] = {}
        self._shared = shared

    def resolve(self, slot_map: SlotMap) -> np.ndarray:
        """The map [L, S] `slot_map` describes. Raises SlotMapUnusable when its base is not held,
        or the map it gives is not the one its digest names."""
        if (slot_map.whole is None) == (slot_map.delta is None):
            raise SlotMapUnusable("a slot map is sent whole or as a delta, exactly one of them")
        base = None
        if slot_map.delta is not None:
            base = self._maps.get(slot_map.delta.base_epoch)
            if base is None:
                raise SlotMapUnusable(f"the slot map came as changes since epoch {slot_map.delta.base_epoch}, whose "
                                      f"map this rank does not hold (it holds epochs {sorted(self._maps)}); the "
                                      "controller sends the whole map to a rank that failed an epoch")
        if self._shared is not None and (hit := self._shared.get(base, slot_map.digest)) is not None:
            return hit
        phy2log = slot_map.whole if base is None else apply_slot_map_delta(base, slot_map.delta)
        if tuple(phy2log.shape) != tuple(slot_map.shape) or slot_map_digest(phy2log) != slot_map.digest:
            raise SlotMapUnusable(f"the slot map {'received' if base is None else 'rebuilt'} "
                                  f"({tuple(phy2log.shape)}) does not match its shape {tuple(slot_map.shape)} and "
                                  "digest; the controller sends the whole map to a rank that failed an epoch")
        if self._shared is not None:
            self._shared.put(base, slot_map.digest, phy2log)
        return phy2log

    def confirm(self, epoch: int, phy2log: np.ndarray) -> None:
        """The rank answered `EpochReady` for `epoch`, whose map is `phy2log` (read-only from now on: a
        base of the next epoch's changes)."""
        phy2log.setflags(write=False)
        self._maps[epoch] = phy2log
        for old in sorted(self._maps)[:-self.KEEP]:
            del self._maps[old]
