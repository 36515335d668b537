"""A straggler episode as the server sees it: per-rank own times per step through the server's own
verdict (`policy/straggler_verdict.py`) and policy (`policy/straggler_policy.py`), reviewed once per
verdict interval as the controller does (`control/faults/straggler_control.py`). `sim fleet` takes the
time to derate and to evict from here, so the fleet runs the policy `serve` runs, with the same
flags, instead of a rule of its own.

What a derate buys is a model: a rank's step is attention (its own DP requests, which cannot
move) plus expert work, `attention_share` of it the former; derating gives the slow rank expert
work in proportion to its speed, so its step, and the group's, takes
(attention_share + (1 - attention_share) x speed) / speed of a healthy one. This is optimistic:
a derated rank keeps its slots and gets the lightest replicas, which may not go that low.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from elastic_ep.policy.straggler_policy import Decision, DecisionKind, PolicyState, StragglerPolicy, decide
from elastic_ep.policy.straggler_verdict import INTERVALS_PER_WINDOW, IntervalRecorder, StragglerRule, judge

HEALTHY_OWN_MS = 20.0  # a healthy rank's own time per decode step in the replay
STEP_TOKENS = 8  # tokens per rank per step in the replay (equal on every rank: no DP imbalance)


def replay(own_ms: Callable[[int, float], float], ranks: Sequence[int], step_s: float, duration_s: float,
           rule: StragglerRule, policy: StragglerPolicy, min_ranks: int, standbys: int = 0,
           ) -> list[tuple[float, Decision]]:
    """Every rank runs a step every `step_s` with own time `own_ms(rank, t)`; the policy reviews the
    members' verdicts once per verdict interval. -> (time, decision) in order; an evicted rank
    leaves the members."""
    recorder, state, members = IntervalRecorder(rule.window_s), PolicyState(), list(ranks)
    review_s = rule.window_s / INTERVALS_PER_WINDOW
    out: list[tuple[float, Decision]] = []
    t, next_review = 0.0, review_s
    while t < duration_s:
        t += step_s
        for r in members:
            recorder.add(t, r, STEP_TOKENS, own_ms(r, t) / 1000)
        if t >= next_review:
            next_review += review_s
            verdicts = judge(recorder.intervals(t), rule, t, members)
            state, decisions = decide(state, policy, verdicts, t, members, min_ranks, standbys)
            out += [(t, d) for d in decisions]
            members = [r for r in members if all(d.kind != DecisionKind.EVICT or d.rank_id != r for d in decisions)]
    return out


@dataclass(frozen=True)
class EpisodeTimes:
    """Seconds from a rank turning slow to the policy derating it and evicting it (None: never
    within `horizon_s`), and the derate weight it got."""

    derate_s: float | None
    evict_s: float | None
    speed: float


@lru_cache(maxsize=32)
def episode_times(rule: StragglerRule, policy: StragglerPolicy, speed: float, ranks: int = 8,
                  horizon_s: float | None = None) -> EpisodeTimes:
    """One rank of `ranks` turns slow (own time / `speed`) after a healthy warm-up of two verdict
    windows and stays slow; the policy's first derate and evict of it, timed from the slowdown.
    The cap and the floor are left out here (the fleet applies them to its own history)."""
    warm_s = 2 * rule.window_s
    horizon_s = horizon_s or policy.evict_after_s + 4 * rule.window_s
    step_s = HEALTHY_OWN_MS / 1000 / speed  # the slow rank sets every step

    def own_ms(r: int, t: float) -> float:
        return HEALTHY_OWN_MS / speed if r == 0 and t > warm_s else HEALTHY_OWN_MS

    unlimited = StragglerPolicy(policy.action, policy.evict_after_s, policy.clear_after_s, ranks, 0.0)
    first: dict[DecisionKind, Decision] = {}
    times: dict[DecisionKind, float] = {}
    for t, d in replay(own_ms, range(ranks), step_s, warm_s + horizon_s, rule, unlimited, 1):
        if d.rank_id == 0 and d.kind not in times:
            times[d.kind], first[d.kind] = t - warm_s, d
    derate = first.get(DecisionKind.DERATE)
    return EpisodeTimes(times.get(DecisionKind.DERATE), times.get(DecisionKind.EVICT),
                        derate.speed if derate is not None else 1.0)


def derated_group_speed(speed: float, attention_share: float) -> float:
    """Speed of a group whose slowest rank (at `speed`) is derated: see the module docstring."""
    return min(speed / (attention_share + (1 - attention_share) * speed), 1.0)
