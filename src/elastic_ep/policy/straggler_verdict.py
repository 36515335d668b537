"""The straggler verdict: which rank is slow, from each rank's own time per step. One definition,
used by the controller (`/cluster`, the dashboard's radar, later its eviction policy) and by the
doctor, so they never disagree about the rule.

A rank's own time is its step time less the time it waited in the all-to-alls: the attention,
expert and sampling work it did itself. Every rank of a collective step lasts as long as the
slowest one, so step times look alike; own time tells the rank the others wait for.

Built so that it does not accuse a healthy rank:
- normalised by tokens: a rank is compared only with ranks that ran at least as many tokens
  per step (DP attention: more tokens is more work). A rank that ran more tokens than the
  others is a DP imbalance (`DP_HEAVY`: same card, more work; fix the scheduling), never a
  straggler (`STRAGGLER`: same or less work, more time; suspect the card or its link).
- relative and absolute excess: own time at least `ratio` x the peers' median AND at least
  `min_excess_ms` above it (1.5 x 2 ms is noise, not a card to replace).
- persistence over fresh samples: samples are summed per interval (the controller's, or the
  doctor's scrapes); a verdict needs `min_steps` steps in at least `min_intervals` of the
  intervals that ended within the last `window_s`, and a straggler is over the line in at least
  `persistence` of them (a rank that was slow for a moment, e.g. its first steps, is not). Older
  intervals do not count: an idle cluster has no verdict (`UNKNOWN`), not a stale one.
- the reference is the others' median, so a slowdown of the whole group accuses nobody.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from elastic_ep.errors import ElasticEPError

INTERVALS_PER_WINDOW = 10  # the controller's interval is window_s / 10: persistence counts tenths


@dataclass(frozen=True)
class StragglerRule:
    """ratio, min_excess_ms: own time per step over the peers' median that counts as slow, both
    must hold. window_s: only intervals that ended this recently count. min_steps,
    min_intervals: the fewest steps, and intervals with steps, in them for any verdict.
    persistence: fraction of the fresh intervals a straggler (or a DP-heavy rank) must be over
    the line in. token_tolerance, min_extra_tokens: rank a runs more
    tokens per step than b when a - b >= max(token_tolerance x b, min_extra_tokens)."""

    ratio: float = 1.5
    min_excess_ms: float = 2.0
    window_s: float = 5.0
    min_steps: int = 10
    persistence: float = 0.8
    min_intervals: int = 4
    token_tolerance: float = 0.1
    min_extra_tokens: float = 0.5

    def __post_init__(self) -> None:
        if not self.ratio > 1:
            raise ElasticEPError(f"--straggler-ratio must be > 1 (a multiple of the peers' median), got {self.ratio}")
        if not self.min_excess_ms >= 0:
            raise ElasticEPError(f"--straggler-min-excess-ms must be >= 0, got {self.min_excess_ms}")
        if not self.window_s > 0:
            raise ElasticEPError(f"--straggler-window-s must be > 0, got {self.window_s}")
        if self.min_steps < 1:
            raise ElasticEPError(f"--straggler-min-steps must be at least 1, got {self.min_steps}")
        if self.min_intervals < 1:
            raise ElasticEPError(f"straggler min_intervals must be at least 1, got {self.min_intervals}")
        if not 0 < self.persistence <= 1:
            raise ElasticEPError(f"--straggler-persistence must be in (0, 1], got {self.persistence}")

    def more_tokens(self, a: float | np.ndarray, b: float | np.ndarray) -> bool | np.ndarray:
        """Whether a rank that ran `a` tokens per step ran notably more than one that ran `b` (numbers,
        or columns of them)."""
        return a - b >= np.maximum(self.token_tolerance * b, self.min_extra_tokens)

    def slow(self, own_ms: float | np.ndarray, reference_ms: float | np.ndarray) -> bool | np.ndarray:
        """Whether own time `own_ms` is slow against `reference_ms` (numbers, or columns of them)."""
        return (own_ms >= self.ratio * reference_ms) & (own_ms - reference_ms >= self.min_excess_ms)

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class RankInterval:
    """One rank's steps in an interval: how many, its own time summed (s), tokens summed."""

    steps: int = 0
    own_s: float = 0.0
    tokens: int = 0

    @property
    def own_ms_per_step(self) -> float:
        return 1000 * self.own_s / self.steps

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps


@dataclass(frozen=True)
class Interval:
    """Samples of every rank between start_s and end_s (one clock for all intervals and `now_s`)."""

    start_s: float
    end_s: float
    ranks: Mapping[int, RankInterval]
    # each rank's part of this interval under a rule as columns, worked out once (`_columns_of`): a
    # closed interval does not change, and the controller judges the same ones at every snapshot
    columns: dict[StragglerRule, _Columns] = field(default_factory=dict, compare=False, repr=False)


class IntervalRecorder:
    """Sums each rank's steps into intervals of window_s / INTERVALS_PER_WINDOW and keeps those
    of the last window. Times are passed in (seconds, any monotonic clock), nothing is read."""

    def __init__(self, window_s: float):
        self.interval_s = window_s / INTERVALS_PER_WINDOW
        self.closed: deque[Interval] = deque(maxlen=INTERVALS_PER_WINDOW + 1)
        self._start_s: float | None = None
        self._open: dict[int, RankInterval] = {}

    def add(self, now_s: float, rank_id: int, tokens: int, own_s: float) -> None:
        """One step of one rank: the tokens it ran and its own time (s)."""
        self.add_step(now_s, (rank_id,), (tokens,), (own_s,))

    def add_step(self, now_s: float, rank_ids: Sequence[int], tokens: Sequence[int], own_s: Sequence[float]) -> None:
        """One step of several ranks (the same order in each argument): what `add` takes of each."""
        self._roll(now_s)
        if self._start_s is None:
            self._start_s = now_s
        opened = self._open
        for rank_id, n, own in zip(rank_ids, tokens, own_s, strict=True):
            r = opened.get(rank_id)
            if r is None:
                r = opened[rank_id] = RankInterval()
            r.steps += 1
            r.own_s += own
            r.tokens += n

    def forget(self, rank_id: int) -> None:
        """Drop a rank's samples (it left: a new process given its id must not inherit them)."""
        self._open.pop(rank_id, None)
        self.closed = deque((Interval(i.start_s, i.end_s, {r: x for r, x in i.ranks.items() if r != rank_id})
                             for i in self.closed), maxlen=self.closed.maxlen)

    def intervals(self, now_s: float) -> list[Interval]:
        """The closed intervals, oldest first (the open one is closed once its time is up)."""
        self._roll(now_s)
        return list(self.closed)

    def _roll(self, now_s: float) -> None:
        if self._start_s is None or now_s - self._start_s < self.interval_s:
            return
        end_s = self._start_s + self.interval_s  # an interval left open while idle ends on time
        self.closed.append(Interval(self._start_s, end_s, self._open))
        self._start_s, self._open = None, {}


class VerdictKind(str, Enum):
    OK = "ok"  # judged on fresh samples, not slow
    STRAGGLER = "straggler"  # same or fewer tokens than its peers, persistently more own time
    DP_HEAVY = "dp-imbalance"  # persistently more tokens per step than the others: DP imbalance
    UNKNOWN = "unknown"  # too few fresh steps for a verdict


@dataclass(frozen=True)
class Verdict:
    """One rank's verdict and the evidence it rests on, over the fresh intervals: `intervals`
    with the rank in them, `over` of those where it was slow against its peers (ranks with at
    least as many tokens; `judged`: intervals where it had any), `heavy` where it ran more
    tokens than the others' median; per step: its own time and tokens, its peers' median own
    time, the others' median own time and tokens. `window_s`: span of the fresh intervals;
    `age_s`: since the newest ended."""

    rank_id: int
    kind: VerdictKind
    steps: int = 0
    intervals: int = 0
    judged: int = 0
    over: int = 0
    heavy: int = 0
    own_ms: float | None = None
    peer_own_ms: float | None = None
    others_own_ms: float | None = None
    tokens_per_step: float | None = None
    others_tokens_per_step: float | None = None
    window_s: float = 0.0
    age_s: float | None = None
    rule: StragglerRule = field(default_factory=StragglerRule)

    @property
    def ratio(self) -> float | None:
        """Own time per step over the peers' median: the one slowness figure, which the evidence,
        `/cluster`, the dashboard's radar and the doctor all show."""
        if self.own_ms is None or self.peer_own_ms is None:
            return None
        return self.own_ms / max(self.peer_own_ms, 1e-9)

    @property
    def evidence(self) -> str:
        """The verdict's grounds in one line, for people."""
        seen = (f"{self.steps} steps in {self.intervals} intervals spanning {self.window_s:.1f}s, newest "
                f"{self.age_s:.1f}s old" if self.age_s is not None else f"no step in the last {self.rule.window_s:g}s")
        if self.kind == VerdictKind.UNKNOWN:
            return f"no verdict: {seen} (needs {self.rule.min_steps} steps in {self.rule.min_intervals} intervals)"
        if self.kind == VerdictKind.DP_HEAVY:
            return (f"runs {self.tokens_per_step:.2f} tokens/step against {self.others_tokens_per_step:.2f} on the "
                    f"others (median) in {self.heavy} of {self.intervals} intervals; own time "
                    f"{self.own_ms:.1f} ms/step against {self.others_own_ms:.1f} ms: more work, not a slower card; "
                    f"{seen}")
        against = (f"against {self.peer_own_ms:.1f} ms on ranks with at least as many tokens "
                   f"({self.ratio:.2f}x)" if self.ratio is not None
                   else "(no rank ran as many tokens to compare with)")
        return (f"own time {self.own_ms:.1f} ms/step {against}, slow in {self.over} of {self.intervals} "
                f"intervals (needs {self.rule.ratio:g}x and +{self.rule.min_excess_ms:g} ms in "
                f"{self.rule.persistence:.0%}); {seen}")

    def to_json(self) -> dict[str, Any]:
        r3 = (lambda v: None if v is None else round(v, 3))  # noqa: E731
        return {"kind": self.kind.value, "evidence": self.evidence, "steps": self.steps,
                "intervals": self.intervals, "judged": self.judged, "over": self.over, "heavy": self.heavy,
                "own_ms": r3(self.own_ms), "peer_own_ms": r3(self.peer_own_ms), "ratio": r3(self.ratio),
                "others_own_ms": r3(self.others_own_ms), "tokens_per_step": r3(self.tokens_per_step),
                "others_tokens_per_step": r3(self.others_tokens_per_step), "window_s": r3(self.window_s),
                "age_s": r3(self.age_s)}


def _medians_without(values: np.ndarray, k: np.ndarray) -> np.ndarray:
    """For each index of `k` [n], statistics.median of the sorted `values` [m] (m >= 2) less the
    one at that index."""
    half, odd = divmod(len(values) - 1, 2)

    def at(i: int) -> np.ndarray:
        return values[np.where(i < k, i, i + 1)]

    return at(half) if odd else (at(half - 1) + at(half)) / 2


def _peer_starts(tokens: np.ndarray, ascending: np.ndarray, rule: StragglerRule) -> np.ndarray:
    """For each of `tokens` [n], the first place in `ascending` [m] (tokens per step, sorted) that
    does not run notably fewer (`more_tokens` holds for a prefix: it is monotonic): one binary
    search for all of them at once, bisect's steps."""
    lo, hi = np.zeros(len(tokens), dtype=np.int64), np.full(len(tokens), len(ascending), dtype=np.int64)
    while (active := lo < hi).any():
        mid = (lo + hi) // 2
        more = rule.more_tokens(tokens, ascending[np.minimum(mid, len(ascending) - 1)])
        lo = np.where(active & more, mid + 1, lo)
        hi = np.where(active & ~more, mid, hi)
    return lo


@dataclass(frozen=True)
class _Columns:
    """One interval's part of each rank with steps under a rule, as columns: [n] each.
    `others`: the rank had others to compare with (`others_ms`, `others_tokens`: their medians of
    own time and tokens per step; `heavy`: it ran notably more tokens than theirs); `peered`: it
    had peers, the others that ran at least about as many tokens (`peer_ms`: their median own
    time; `over`: it was slow against it). 0 where it had none."""

    rank_ids: np.ndarray
    steps: np.ndarray
    own_s: np.ndarray
    tokens: np.ndarray
    others: np.ndarray
    others_ms: np.ndarray
    others_tokens: np.ndarray
    heavy: np.ndarray
    peered: np.ndarray
    peer_ms: np.ndarray
    over: np.ndarray


def _peer_medians(own: np.ndarray, order: np.ndarray, position: np.ndarray, start: np.ndarray) -> tuple[
        np.ndarray, np.ndarray]:
    """(peer_ms, peered) [n]: each rank's median own time over its peers, the ranks at places
    `start` on of the token order (`order`: the ranks in it, `position`: each rank's place), itself
    left out where it is one of them.

    A median of the peers less one value needs only three of their order statistics (the middle
    and its neighbours), and which of them from how they compare with the value left out. So the
    peers' own times are sorted once, grown from the heaviest rank down (one insort a rank), and
    read three times a distinct start (most decode intervals have one), not once a rank."""
    n = len(own)
    starts, group = np.unique(start, return_inverse=True)
    size = n - starts  # [G] each start's peers (a rank itself included where it is one)
    table = np.zeros((len(starts), 3))  # [G, 3] order statistics size // 2 - 1 + c of each start's peers
    ascending = own[order].tolist()
    peers: list[float] = []  # the own times at places j on, sorted
    j = n
    for g in range(len(starts) - 1, -1, -1):
        first = int(starts[g])
        while j > first:
            j -= 1
            bisect.insort(peers, ascending[j])
        if peers:
            table[g] = [peers[min(max(len(peers) // 2 - 1 + c, 0), len(peers) - 1)] for c in range(3)]
    size, ranks = size[group], np.arange(n)
    stats = table[group]  # [n, 3]

    def value(i: np.ndarray) -> np.ndarray:  # the order statistic i of a rank's peers (itself included)
        return stats[ranks, np.clip(i - (size // 2 - 1), 0, 2)]

    inside = position >= start  # the rank is one of its own peers: left out of its median
    m = np.where(inside, size - 1, size)  # how many the median is over

    def at(i: np.ndarray) -> np.ndarray:  # the i-th of them: past the rank's own value, the next one up
        v = value(i)
        return np.where(inside & (v >= own), value(i + 1), v)

    half = m // 2
    medians = np.where(m % 2 == 1, at(half), (at(half - 1) + at(half)) / 2)
    peered = m >= 1
    return np.where(peered, medians, 0.0), peered


def _interval_columns(interval: Interval, rule: StragglerRule) -> _Columns:
    """Each rank's part of one interval. The peers of a rank are a suffix of the ranks ordered by
    tokens (`more_tokens` is monotonic), found for all ranks by one vectorized binary search, and
    their medians from a few order statistics (`_peer_medians`). At 1,024 ranks this was a Python
    loop of bisections and insorts per rank."""
    ranks = [(r, x) for r, x in interval.ranks.items() if x.steps > 0]
    n = len(ranks)
    ids = np.array([r for r, _ in ranks], dtype=np.int64)
    steps = np.array([x.steps for _, x in ranks], dtype=np.float64)
    own_s = np.array([x.own_s for _, x in ranks], dtype=np.float64)
    tokens = np.array([x.tokens for _, x in ranks], dtype=np.float64)
    none, zeros = np.zeros(n, dtype=bool), np.zeros(n)
    if n < 2:
        return _Columns(ids, steps, own_s, tokens, none, zeros, zeros, zeros, none, zeros, zeros)
    own, per_step = 1000 * own_s / steps, tokens / steps  # RankInterval.own_ms_per_step, tokens_per_step
    by_own, by_tokens = np.sort(own), np.sort(per_step)
    others_ms = _medians_without(by_own, np.searchsorted(by_own, own))
    others_tokens = _medians_without(by_tokens, np.searchsorted(by_tokens, per_step))
    order = np.argsort(per_step, kind="stable")  # lightest first
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    peer_ms, peered = _peer_medians(own, order, position, _peer_starts(per_step, per_step[order], rule))
    over = peered & rule.slow(own, peer_ms)
    return _Columns(ids, steps, own_s, tokens, np.ones(n, dtype=bool), others_ms, others_tokens,
                    rule.more_tokens(per_step, others_tokens).astype(np.float64), peered, peer_ms,
                    over.astype(np.float64))


def _columns_of(interval: Interval, rule: StragglerRule) -> _Columns:
    """`_interval_columns`, kept on the interval for the next judgement under the same rule."""
    cols = interval.columns.get(rule)
    if cols is None:
        cols = interval.columns[rule] = _interval_columns(interval, rule)
    return cols


def judge(intervals: Sequence[Interval], rule: StragglerRule, now_s: float,
          rank_ids: Iterable[int] = ()) -> dict[int, Verdict]:
    """A verdict for every rank in the fresh intervals (ended within rule.window_s of now_s) and
    for every one of `rank_ids` (UNKNOWN when it has no fresh step).

    Each rank's counts and sums over the fresh intervals are numpy sums of the intervals' columns
    (`_columns_of`, built once per closed interval), not a Python loop over every rank of every
    interval: at 1,024 ranks the controller judges ~10,000 rows twice a second."""
    fresh = [i for i in intervals if now_s - i.end_s <= rule.window_s]
    verdicts: dict[int, Verdict | None] = dict.fromkeys(rank_ids)  # their order first, filled below
    cols = [c for c in (_columns_of(i, rule) for i in fresh) if len(c.rank_ids)]
    if cols:
        span_s = max(i.end_s for i in fresh) - min(i.start_s for i in fresh)
        age_s = now_s - max(i.end_s for i in fresh)
        ranks, at = np.unique(np.concatenate([c.rank_ids for c in cols]), return_inverse=True)

        def total(name: str, where: str | None = None) -> np.ndarray:
            values = np.concatenate([getattr(c, name) for c in cols])
            if where is not None:
                values = np.where(np.concatenate([getattr(c, where) for c in cols]), values, 0.0)
            return np.bincount(at, weights=values, minlength=len(ranks))

        def means(sums: np.ndarray, counts: np.ndarray) -> list[float | None]:
            return [m if c else None for m, c in zip((sums / np.maximum(counts, 1)).tolist(), counts.tolist(),
                                                     strict=True)]

        steps, own_s, tokens, others, peered = (total(n) for n in ("steps", "own_s", "tokens", "others", "peered"))
        heavy, over = total("heavy"), total("over")
        intervals_in = np.bincount(at, minlength=len(ranks))
        needed = rule.persistence * intervals_in - 1e-9
        known = (steps >= rule.min_steps) & (intervals_in >= rule.min_intervals)
        kind_of = (VerdictKind.UNKNOWN, VerdictKind.STRAGGLER, VerdictKind.DP_HEAVY, VerdictKind.OK)
        kinds = [kind_of[k] for k in np.where(~known, 0, np.where(
            over >= needed, 1, np.where(heavy >= needed, 2, 3))).tolist()]
        peer, other = means(total("peer_ms", "peered"), peered), means(total("others_ms", "others"), others)
        other_tokens = means(total("others_tokens", "others"), others)
        own_ms, tokens_per_step = (1000 * own_s / steps).tolist(), (tokens / steps).tolist()
        counts = zip(ranks.tolist(), *(x.astype(np.int64).tolist() for x in (steps, intervals_in, peered, over, heavy)),
                     strict=True)
        for k, (r, n, m, j, o, h) in enumerate(counts):
            verdicts[r] = Verdict(r, kinds[k], n, m, j, o, h, own_ms[k], peer[k], other[k], tokens_per_step[k],
                                  other_tokens[k], span_s, age_s, rule)
    return {r: v if v is not None else Verdict(r, VerdictKind.UNKNOWN, rule=rule) for r, v in verdicts.items()}
