"""The ranks' timing rings (control/rank_timings.py) hold what a deque per rank and series held:
each rank's last `window` values (its own answers, whatever steps others answered), the same
/cluster percentiles to the microsecond, the same sums; a new record of a rank id starts empty,
never with its id's last owner's values; columns grow as rank ids come."""

from __future__ import annotations

import random
from collections import deque

import numpy as np

from elastic_ep.control.rank_timings import WINDOWS, RankTimings


def deque_percentiles_ms(values) -> dict[str, float] | None:
    """The /cluster percentiles as they were computed from a rank's deque."""
    if not values:
        return None
    a = sorted(v * 1000 for v in values)

    def at(q: float) -> float:
        x = q * (len(a) - 1)
        lo = int(x)
        hi = min(lo + 1, len(a) - 1)
        return a[lo] + (a[hi] - a[lo]) * (x - lo)

    def us(ms: float) -> float:  # to the microsecond, as numpy rounds (`np.round`, which the rings use)
        return float(np.round(ms, 3))

    return {"p50": us(at(0.5)), "p99": us(at(0.99)), "max": us(a[-1])}


def test_the_windows_are_the_deques():
    assert WINDOWS == {"step_s": 256, "wait_s": 256, "own_s": 256, "link_s": 256, "slot_tokens": 64}


def test_percentiles_sums_and_windows_match_a_deque_per_rank_through_wraps_and_gaps():
    rng = random.Random(3)
    windows = {"step_s": 7, "slot_tokens": 3}
    rings = RankTimings(windows, columns=2)  # grown as the ranks come
    ranks = list(range(9))
    kept = {(s, r): deque(maxlen=w) for s, w in windows.items() for r in ranks}
    for _ in range(40):
        answered = rng.sample(ranks, rng.randint(0, len(ranks)))  # a rank outside a step keeps its window
        for series in windows:
            values = [rng.choice([rng.random() / 10, 0.01, 0.0125]) if series == "step_s" else rng.randint(0, 9)
                      for _ in answered]
            rings.write(series, answered, answered, values)  # record = rank id here
            for r, v in zip(answered, values, strict=True):
                kept[series, r].append(v)
        assert rings.percentiles_ms("step_s", ranks, ranks) == [deque_percentiles_ms(kept["step_s", r]) for r in ranks]
        assert rings.sums("slot_tokens", ranks, ranks).tolist() == [sum(kept["slot_tokens", r]) for r in ranks]
        for r in ranks:
            assert rings.window("step_s", r, r) == list(kept["step_s", r])


def test_a_new_record_of_a_rank_id_starts_empty():
    rings = RankTimings({"step_s": 4, "link_s": 4})
    rings.write("step_s", [0, 1], [10, 11], [0.5, 0.25])
    rings.write("link_s", [0, 1], [10, 11], [0.001, 0.002])
    # rank 1's id taken by a new process (record 12): read before it wrote anything, it has nothing
    assert rings.percentiles_ms("step_s", [0, 1], [10, 12]) == [{"p50": 500.0, "p99": 500.0, "max": 500.0}, None]
    assert rings.window("link_s", 1, 12) == [] and rings.sums("step_s", [1], [12]).tolist() == [0.0]
    rings.write("step_s", [1], [12], [0.125])
    assert rings.window("step_s", 1, 12) == [0.125] and rings.window("link_s", 1, 12) == []
    assert rings.window("step_s", 1, 11) == []  # the old record's values are gone
    assert rings.window("step_s", 0, 10) == [0.5]


def test_a_rank_never_written_reads_empty():
    rings = RankTimings()
    assert rings.percentiles_ms("own_s", [5], [1]) == [None] and rings.window("own_s", 5, 1) == []
    assert rings.percentiles_ms("own_s", [], []) == []
