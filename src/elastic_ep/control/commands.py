"""What the HTTP thread asks of the control thread: typed commands through one queue.

The HTTP side never writes cluster state; it enqueues one of these and wakes the control
thread, which carries them out between its waits (within milliseconds, a step or an epoch
change in flight included). A command that needs an answer carries a future.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from .scheduler import Sequence
from .streams import Stream


@dataclass(frozen=True)
class AddRequest:
    seq: Sequence
    stream: Stream


@dataclass(frozen=True)
class AbortRequest:
    seq_id: int


@dataclass(frozen=True)
class StartScale:
    """Answered with {"old_ep_size", "new_ep_size"} or a ScaleRejected exception."""

    new_ep_size: int
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


Command = AddRequest | AbortRequest | StartScale | SignalRank | SlowRank | CorruptExpertSlot
