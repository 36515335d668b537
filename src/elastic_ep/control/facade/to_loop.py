"""What the HTTP thread asks of the control thread: typed commands through one queue.

The HTTP side never writes cluster state; it enqueues one of these and wakes the control
thread, which carries them out between its waits (within milliseconds, a step or an epoch
change in flight included). A command that needs an answer carries a future.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..serving.scheduler import Sequence
from ..serving.streams import Stream


@dataclass(frozen=True)
class AddRequest:
    seq: Sequence
    stream: Stream


@dataclass(frozen=True)
class AbortRequest:
    seq_id: int


@dataclass(frozen=True)
class StartScale:
    """To `new_ep_size`, retiring `ranks` when given; answered with {"old_ep_size",
    "new_ep_size"} or a ScaleRejected exception."""

    new_ep_size: int
    reply: Future
    ranks: list[int] | None = None


@dataclass(frozen=True)
class StartDrain:
    """Retire `ranks`, or every rank of `node` (cordoned); answered with {"ranks", "node",
    "old_ep_size", "new_ep_size"} or a ScaleRejected exception."""

    ranks: list[int] | None
    node: str | None
    reply: Future


@dataclass(frozen=True)
class Uncordon:
    """New ranks may start on `node` again; answered with {"node", "cordoned"} or ScaleRejected."""

    node: str
    reply: Future


@dataclass(frozen=True)
class StartRollout:
    """Replace every worker process, one at a time, by one started with `options` (WorkerLaunch
    fields, membership/rollout_rules.py); answered with the rollout view or a ScaleRejected exception."""

    options: dict[str, Any]
    reply: Future


@dataclass(frozen=True)
class AbortRollout:
    """Replace no rank after the one in flight; answered with the rollout view or ScaleRejected."""

    reply: Future


@dataclass(frozen=True)
class Sleep:
    """Sleep at `level` (1 or 2); answered with the sleep view once every rank answered, or a
    ScaleRejected exception."""

    level: int
    reply: Future


@dataclass(frozen=True)
class WakeUp:
    """Wake from a sleep; answered with the sleep view once every rank answered."""

    reply: Future


@dataclass(frozen=True)
class SignalRank:
    """Chaos: send `signal` to the rank's process, now or right after the next epoch is announced
    (a fault that lands while that epoch forms)."""

    rank_id: int
    signal: int
    at_next_epoch: bool = False


@dataclass(frozen=True)
class SlowRank:
    """Chaos: the rank sleeps `delay_s` in every step (0 ends it)."""

    rank_id: int
    delay_s: float


@dataclass(frozen=True)
class CorruptExpertSlot:
    """Chaos: overwrite the weights of (layer, slot) of the rank in place."""

    rank_id: int
    layer: int
    slot: int


@dataclass(frozen=True)
class PoisonRequest:
    """Chaos: every step of the running requests whose id starts with `request_id` raises on its
    rank, in `phase` ("local", "experts" or "sampling"), as a request that breaks a step would."""

    request_id: str
    phase: str


@dataclass(frozen=True)
class PoisonRank:
    """Chaos: every step of the rank raises in `phase`, whatever it runs (a broken rank)."""

    rank_id: int
    phase: str


@dataclass(frozen=True)
class CutNetwork:
    """Chaos: cut (or, with `heal`, heal) the links of rank `rank_id` (None: of node `node`)."""

    node: str
    rank_id: int | None
    duration_s: float = 0.0
    heal: bool = False


class Lost(str, Enum):
    """What of the next step is lost on the way: the rank's answer (it runs the step and keeps the
    answer), or its plan (it never runs the step)."""

    RESULT = "result"
    PLAN = "plan"


@dataclass(frozen=True)
class LoseMessage:
    """Chaos: the rank's answer to, or plan of, the next step is lost on the way."""

    rank_id: int
    lost: Lost


ChaosCommand = SignalRank | SlowRank | CorruptExpertSlot | PoisonRequest | PoisonRank | CutNetwork | LoseMessage
Command = (AddRequest | AbortRequest | StartScale | StartDrain | Uncordon | StartRollout | AbortRollout | Sleep | WakeUp
           | ChaosCommand)
