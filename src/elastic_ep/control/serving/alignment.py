"""Per-step DP alignment: even the tokens each rank brings to a step's
all-to-all, since the step lasts as long as its busiest rank and the others wait at the
collective. Pure rules; the scheduler applies them every step.

- Level: a rank runs its decode tokens (one per decoding sequence: they cannot be cut), then
  prefill up to the step's level, the mean of what the ranks would bring uncut, but at least
  `min_chunk` prefill tokens when it has any (prefill always progresses), never more than the
  token budget. A prompt's prefill then spreads over steps instead of making one step long for
  every rank. With no decode token anywhere nothing is cut: no one waits on the step's length.
- Unstarted prefills (no KV anywhere yet) are placed again every step on the rank with the
  least work, so they follow the load instead of staying where they were admitted.
- Decode sequences: when the same rank has had at least two decoding sequences more than the
  least loaded rank for `patience` steps in a row, one of its sequences moves there, with its
  KV cache (`kv`: copied rank to rank, runtime/kv_move.py) or by re-prefill (`reprefill`:
  prompt plus tokens so far recomputed on the new rank).
- What is left uneven is padded in the all-to-all (`--padded-dispatch-max-tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

MIGRATE_MODES = ("off", "kv", "reprefill")


@dataclass(frozen=True)
class AlignRule:
    """enabled: cut prefill to the step's level and re-place unstarted prefills; min_chunk:
    least prefill tokens a rank with prefill runs per step; migrate: how a decoding sequence
    moves ("off", "kv", "reprefill"); patience: steps the same rank stays the busiest first."""

    enabled: bool = True
    min_chunk: int = 32
    migrate: str = "kv"
    patience: int = 8

    def __post_init__(self) -> None:
        if self.migrate not in MIGRATE_MODES:
            raise ValueError(f"migrate {self.migrate!r} is not one of {', '.join(MIGRATE_MODES)}")
        if self.min_chunk < 1 or self.patience < 1:
            raise ValueError(f"min_chunk ({self.min_chunk}) and patience ({self.patience}) must be at least 1")


def rank_caps(decode: dict[int, int], prefill: dict[int, int], budget: int, min_chunk: int) -> dict[int, int]:
    """Tokens each rank may run in the next step.

    decode: decode tokens per rank (never cut); prefill: prefill tokens pending per rank;
    budget: --max-num-batched-tokens. Returns rank -> cap, never below the rank's decode tokens.
    """
    if not any(decode.values()):
        return dict.fromkeys(decode, budget)
    wanted = [min(decode[r] + prefill[r], budget) for r in decode]
    level = max(-(-sum(wanted) // len(wanted)), max(decode.values()))
    return {r: max(decode[r], min(budget, max(level, decode[r] + min(min_chunk, prefill[r])))) for r in decode}


def imbalance(tokens: Iterable[int]) -> float | None:
    """Max over mean of tokens per rank (1.0 = even); None when no rank has any."""
    values = list(tokens)
    total = sum(values)
    return max(values) / (total / len(values)) if total else None


class Decoding(Protocol):
    seq_id: int
    num_cached: int

    @property
    def remaining(self) -> int: ...


def sequence_to_move(candidates: list[Decoding]) -> Decoding:
    """The decoding sequence worth moving: the most tokens still to generate (it keeps the new
    rank busy longest), then the shortest history (the cheapest to copy or recompute)."""
    return min(candidates, key=lambda s: (-s.remaining, s.num_cached, s.seq_id))


class DecodeBalance:
    """Watches decoding sequences per rank step by step and names a move (src, dst) when the
    same rank has stayed the busiest, two or more above the least loaded rank that can take one,
    for `patience` steps in a row."""

    def __init__(self, patience: int):
        self.patience = patience
        self.busiest: int | None = None
        self.streak = 0

    def observe(self, counts: dict[int, int], takers: set[int]) -> tuple[int, int] | None:
        """counts: decoding sequences per rank this step; takers: ranks with room for one more."""
        if not counts:
            return None
        busiest = max(counts, key=lambda r: (counts[r], -r))
        open_ranks = [r for r in takers if r != busiest]
        least = min(open_ranks, key=lambda r: (counts.get(r, 0), r)) if open_ranks else None
        if least is None or counts[busiest] - counts.get(least, 0) < 2:
            self.busiest, self.streak = None, 0
            return None
        self.streak = self.streak + 1 if busiest == self.busiest else 1
        self.busiest = busiest
        if self.streak < self.patience:
            return None
        self.busiest, self.streak = None, 0
        return busiest, least
