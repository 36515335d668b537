"""The straggler policy: what is done about a rank the straggler verdict (`policy/straggler_verdict.py`)
names. One definition, applied by the controller (`control/faults/straggler_control.py`) to the verdicts
of the live cluster and by `sim fleet` to the verdicts of the per-rank timings it models, so the
simulator credits the server with what the server does.

- derate at once: the first straggler verdict gives the rank a speed weight (its peers' own time
  over its own) and the controller re-places experts with it, in an epoch with the same members:
  the slow rank gets the lighter replicas. Its attention (DP) work cannot move, so derating wins
  back only the expert share of its slowness.
- evict when it stays slow: `evict_after_s` of straggler verdicts without a break, and the rank
  is fenced and replaced (from a warm standby when there is one). A verdict that is not
  "straggler" (ok, no verdict for lack of fresh steps, DP imbalance) restarts that clock, so a
  rank that flaps is derated once and evicted only if one slow stretch lasts the whole window;
  an idle cluster never evicts on stale evidence.
- hysteresis: a derated rank gets its full weight back only after `clear_after_s` of "ok"
  verdicts without a break, so a placement does not flap with the rank.
- limits: at most `max_evictions` in any `eviction_window_s`; never below `min_ranks` (the
  fewest ranks whose slots hold every expert: a standby that takes the place does not count as
  a loss); nobody is evicted or derated while more than half the members are stragglers at once
  (a slowdown of the whole group: network, power, a neighbour on every host). The verdict's
  reference is the others' median, so a uniform slowdown names nobody in the first place.
Every decision carries the reason and the verdict's evidence; refusals (HOLD) are decisions too,
made once per slow stretch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from elastic_ep.errors import ElasticEPError

from .straggler_verdict import StragglerRule, Verdict, VerdictKind

GROUP_SLOWDOWN_FRACTION = 0.5  # more members than this fraction named at once: a group slowdown, act on none
MIN_SPEED = 0.05  # a derate weight below this would leave a rank no expert work at all


class StragglerAction(str, Enum):
    OFF = "off"  # verdicts are shown, nothing is done
    DERATE = "derate"  # a straggler gets lighter experts at once; never evicted
    EVICT = "evict"  # derated at once, evicted when it stays slow


@dataclass(frozen=True)
class StragglerPolicy:
    """The policy's parameters (flags `--straggler-policy`, `--straggler-evict-after-s`, ...;
    `commands/straggler_options.py` makes them for `serve` and `sim fleet` alike)."""

    action: StragglerAction = StragglerAction.EVICT
    evict_after_s: float = 60.0
    clear_after_s: float = 30.0
    max_evictions: int = 1
    eviction_window_s: float = 3600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", StragglerAction(self.action))
        for name in ("evict_after_s", "clear_after_s", "eviction_window_s"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ElasticEPError(f"--straggler-{name.replace('_', '-')} must be a number >= 0, got {value}")
        if self.max_evictions < 0:
            raise ElasticEPError(f"--straggler-max-evictions must be >= 0, got {self.max_evictions}")

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "action": self.action.value}


# flag (`serve` / `sim fleet`, as a ServeConfig field name) -> (the dataclass it sets, its field there)
FLAG_FIELDS: dict[str, tuple[type, str]] = {
    "straggler_ratio": (StragglerRule, "ratio"),
    "straggler_min_excess_ms": (StragglerRule, "min_excess_ms"),
    "straggler_window_s": (StragglerRule, "window_s"),
    "straggler_min_steps": (StragglerRule, "min_steps"),
    "straggler_persistence": (StragglerRule, "persistence"),
    "straggler_policy": (StragglerPolicy, "action"),
    "straggler_evict_after_s": (StragglerPolicy, "evict_after_s"),
    "straggler_clear_after_s": (StragglerPolicy, "clear_after_s"),
    "straggler_max_evictions": (StragglerPolicy, "max_evictions"),
    "straggler_eviction_window_s": (StragglerPolicy, "eviction_window_s"),
}


def from_flags(values: Mapping[str, Any]) -> tuple[StragglerRule, StragglerPolicy]:
    """The verdict's rule and the policy from flag values by FLAG_FIELDS name (others ignored)."""
    given: dict[type, dict[str, Any]] = {StragglerRule: {}, StragglerPolicy: {}}
    for name, (cls, attr) in FLAG_FIELDS.items():
        given[cls][attr] = values[name]
    return StragglerRule(**given[StragglerRule]), StragglerPolicy(**given[StragglerPolicy])


class DecisionKind(str, Enum):
    DERATE = "derate"  # re-place experts with this rank at `speed`
    RESTORE = "restore"  # it is ok again: full weight
    EVICT = "evict"  # fence and replace it
    HOLD = "hold"  # an eviction (or any action) the limits refuse; `reason` says which


@dataclass(frozen=True)
class Decision:
    kind: DecisionKind
    rank_id: int | None  # None: the whole group (a group slowdown)
    reason: str
    evidence: str = ""
    speed: float = 1.0


@dataclass(frozen=True)
class RankCase:
    """A rank the policy acts on: its derate weight, since when its straggler verdicts run without
    a break (`slow_since_s`), since when its "ok" verdicts do (`ok_since_s`), and whether an
    eviction of this stretch was refused already (the refusal is said once; it is retried)."""

    speed: float
    slow_since_s: float | None
    ok_since_s: float | None = None
    held: bool = False


@dataclass(frozen=True)
class PolicyState:
    """Open cases by rank, times of recent evictions, and whether a group slowdown is being held."""

    cases: Mapping[int, RankCase] = field(default_factory=dict)
    evictions_s: tuple[float, ...] = ()
    group_held: bool = False

    def speeds(self) -> dict[int, float]:
        """rank -> derate weight of every derated rank (others are 1.0)."""
        return {r: c.speed for r, c in self.cases.items()}

    def to_json(self, now_s: float) -> dict[str, Any]:
        return {"derated": {str(r): {"speed": round(c.speed, 3),
                                     "slow_for_s": None if c.slow_since_s is None else round(now_s - c.slow_since_s, 1),
                                     "ok_for_s": None if c.ok_since_s is None else round(now_s - c.ok_since_s, 1)}
                            for r, c in sorted(self.cases.items())},
                "evictions_s_ago": [round(now_s - t, 1) for t in self.evictions_s], "group_slowdown": self.group_held}


def derate_speed(verdict: Verdict) -> float:
    """Its peers' own time per step over its own (the verdict's figures), in [MIN_SPEED, 1]."""
    reference = verdict.peer_own_ms if verdict.peer_own_ms is not None else verdict.others_own_ms
    if not verdict.own_ms or reference is None:
        return 1.0
    return min(max(reference / verdict.own_ms, MIN_SPEED), 1.0)


def eviction_refusal(policy: StragglerPolicy, evictions_s: Sequence[float], now_s: float, members: int,
                     min_ranks: int, standbys: int) -> str | None:
    """Why an eviction may not happen now (None: it may): the cap over the window, or the size
    that holds every expert (a standby taking the place keeps the size)."""
    recent = [t for t in evictions_s if now_s - t < policy.eviction_window_s]
    if len(recent) >= policy.max_evictions:
        return (f"--straggler-max-evictions {policy.max_evictions} reached in the last "
                f"{policy.eviction_window_s:g}s (--straggler-eviction-window-s)")
    after = members - (0 if standbys > 0 else 1)
    if after < min_ranks:
        return (f"evicting would leave {after} ranks, fewer than the {min_ranks} that hold every expert, and no "
                "standby is ready (--standby-ranks)")
    return None


def decide(state: PolicyState, policy: StragglerPolicy, verdicts: Mapping[int, Verdict], now_s: float,
           members: Sequence[int], min_ranks: int, standbys: int) -> tuple[PolicyState, list[Decision]]:
    """The decisions for the members' current verdicts at `now_s`, and the state after them.
    At most one eviction per call; `standbys`: warm ranks ready to take an evicted rank's place."""
    if policy.action == StragglerAction.OFF:
        return PolicyState(), []
    cases = {r: c for r, c in state.cases.items() if r in members}
    evictions = tuple(t for t in state.evictions_s if now_s - t < policy.eviction_window_s)
    kinds = {r: verdicts[r].kind if r in verdicts else VerdictKind.UNKNOWN for r in members}
    stragglers = sorted(r for r, k in kinds.items() if k == VerdictKind.STRAGGLER)
    decisions: list[Decision] = []
    if len(members) > 1 and len(stragglers) > GROUP_SLOWDOWN_FRACTION * len(members):
        if not state.group_held:
            decisions.append(Decision(DecisionKind.HOLD, None, (
                f"ranks {stragglers} of {len(members)} are stragglers at once: a slowdown of the whole group "
                "(network, power, a shared neighbour), not a card to evict; nothing is done")))
        return PolicyState(cases, evictions, True), decisions
    evicted = False
    for r in members:
        case, verdict = cases.get(r), verdicts.get(r)
        if kinds[r] == VerdictKind.STRAGGLER:
            assert verdict is not None
            if case is None:
                case = RankCase(derate_speed(verdict), now_s)
                decisions.append(Decision(DecisionKind.DERATE, r, f"rank {r} is a straggler: derated to speed "
                                          f"{case.speed:.2f} (lighter experts)", verdict.evidence, case.speed))
            elif case.slow_since_s is None:  # a new slow stretch
                case = replace(case, slow_since_s=now_s, held=False)
            case = replace(case, ok_since_s=None)
            slow_s = now_s - case.slow_since_s
            if policy.action == StragglerAction.EVICT and slow_s >= policy.evict_after_s and not evicted:
                refusal = eviction_refusal(policy, evictions, now_s, len(members), min_ranks, standbys)
                if refusal is None:
                    evicted = True
                    evictions += (now_s,)
                    decisions.append(Decision(DecisionKind.EVICT, r, f"rank {r} stayed a straggler for {slow_s:.1f}s "
                                              f"(--straggler-evict-after-s {policy.evict_after_s:g}): evicted",
                                              verdict.evidence, case.speed))
                    cases.pop(r, None)
                    continue
                if not case.held:
                    decisions.append(Decision(DecisionKind.HOLD, r, f"rank {r} stayed a straggler for {slow_s:.1f}s "
                                              f"but is not evicted: {refusal}", verdict.evidence, case.speed))
                case = replace(case, held=True)
            cases[r] = case
        elif case is not None:
            ok = kinds[r] == VerdictKind.OK  # no verdict or DP imbalance is no evidence of health: a break
            ok_since = (now_s if case.ok_since_s is None else case.ok_since_s) if ok else None
            case = replace(case, slow_since_s=None, ok_since_s=ok_since)
            if case.ok_since_s is not None and now_s - case.ok_since_s >= policy.clear_after_s:
                decisions.append(Decision(DecisionKind.RESTORE, r, (
                    f"rank {r} has been ok for {now_s - case.ok_since_s:.1f}s (--straggler-clear-after-s "
                    f"{policy.clear_after_s:g}): full weight again"), verdict.evidence if verdict else ""))
                cases.pop(r)
                continue
            cases[r] = case
    return PolicyState(cases, evictions, False), decisions
