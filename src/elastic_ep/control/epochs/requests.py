"""What an epoch change is asked to do: one typed request per job, instead of mode flags.

Each request says over which ranks the next epoch forms, which of them hold experts and get
requests (`holding`), how the placement is found, and whether the members keep their process
group. `EpochChanger.change` reads only these; its outcome (epoch_change.py) goes back to the
caller.

| request | members | placement | group |
|---|---|---|---|
| `Start` | `live` | balanced over `live` | new |
| `Recover` | `live`; `holding` get requests | restore: only experts with no live copy move | new |
| `Rejoin` | `live` | restore (the joiners start empty) | new |
| `Refill` | the current members | unchanged; the suspect slots are filled again | kept |
| `Move` | the current members | `target` (one step of the background rebalance) | kept |
| `Reweight` | the current members | `target` (the straggler policy's speed weights) | new |
| `ScaleStep` | `live`; `holding` get requests | `target`, else balanced over `holding` | new |
| `Adopt` | `live` (ranks a new leader adopted) | restore from `placement` on the `whole` ranks | new |
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_ep.placement.location import ExpertLocation

Slot = tuple[int, int, int]  # (rank_id, layer, slot within the rank)


@dataclass(frozen=True)
class Start:
    """The first epoch, over every rank that registered; `target`: its placement when it was
    computed before (read once, copy many: the backup is read for it first)."""

    live: list[int]
    target: ExpertLocation | None = None


@dataclass(frozen=True)
class Recover:
    """After a fault: the survivors and the ranks taken in (`live`); `holding` are those that stay
    (a leaving rank of a scale-down only sends what it holds)."""

    live: list[int]
    holding: list[int]


@dataclass(frozen=True)
class Rejoin:
    """Registered ranks (restarted, standbys) admitted at a step boundary."""

    live: list[int]


@dataclass(frozen=True)
class Refill:
    """Fill again the slots that failed a check (`slots`), from a clean copy."""

    slots: list[Slot]


@dataclass(frozen=True)
class Move:
    """One move of the background rebalance towards `target`."""

    target: ExpertLocation


@dataclass(frozen=True)
class Reweight:
    """A placement with the straggler policy's speed weights, same members."""

    target: ExpertLocation


@dataclass(frozen=True)
class ScaleStep:
    """One epoch of a scale: up (`live` with the joiners), the first of a scale-down (`holding` the
    staying ranks), or its second (`live` the staying ranks, `target` the trimmed placement)."""

    live: list[int]
    holding: list[int] | None = None
    target: ExpertLocation | None = None


@dataclass(frozen=True)
class Adopt:
    """A new leader of the controller group takes over running ranks (control/membership/adoption.py):
    `live` registered with it; `whole` of them hold `placement` (the last leader's) whole in their
    slots; the epoch is numbered past `after_epoch`, the highest any of them was told of."""

    live: list[int]
    whole: list[int]
    placement: ExpertLocation
    after_epoch: int


EpochRequest = Start | Recover | Rejoin | Refill | Move | Reweight | ScaleStep | Adopt


def holding_of(request: EpochRequest, live: list[int]) -> list[int]:
    """The ranks of the epoch over `live` that hold experts and get requests (default all)."""
    holding = getattr(request, "holding", None)
    return list(live) if holding is None else list(holding)


def same_members(request: EpochRequest) -> bool:
    """The request keeps the current epoch's members."""
    return isinstance(request, Refill | Move | Reweight)


def keeps_group(request: EpochRequest) -> bool:
    """The members keep their healthy process group (no rendezvous): a refill or a move, formed at a
    step boundary with no fault pending."""
    return isinstance(request, Refill | Move)


def restores(request: EpochRequest) -> bool:
    """Every expert stays where it is and only those no live rank holds get a slot."""
    return isinstance(request, Recover | Rejoin | Adopt)
