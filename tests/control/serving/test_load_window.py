"""The EPLB load window (control/serving/load_window.py): the estimate the rebalance and a restore
read is the one a window of every step's array gave, and what it holds grows with the reports
in the window, not with its steps."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from elastic_ep.control.serving.load_window import LoadWindow

L, E = 3, 16


def every_step_estimate(window: deque[np.ndarray]) -> np.ndarray:
    """What the step loop computed before: one [L, E] array per step, zeros included, summed."""
    total = np.zeros((L, E), dtype=np.float64)
    for counts in window:
        total += counts
    return total + 1.0 if total.sum() > 0 else np.ones((L, E))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("steps", [1, 7, 200])
def test_the_estimate_is_the_one_every_steps_array_gave(seed, steps):
    rng = np.random.default_rng(seed)
    report_every = int(rng.integers(1, 20))
    old: deque[np.ndarray] = deque(maxlen=steps)
    new = LoadWindow(steps, L, E)
    for step in range(3 * steps + 50):
        idle = (step // 40) % 3 == 1  # stretches with no report at all, longer than a small window
        load = None if idle or step % report_every else rng.integers(0, 1000, (L, E), dtype=np.int64)
        old.append(np.zeros((L, E), dtype=np.int64) if load is None else load)
        new.add(load)
        assert len(new) == len(old)
        np.testing.assert_array_equal(new.estimate(), every_step_estimate(old))


def test_the_memory_held_is_bounded_by_the_reports_not_the_steps():
    array_bytes = L * E * 8
    window = LoadWindow(200, L, E)
    for _ in range(1000):
        window.add(None)
    assert len(window) == 200 and window.held_bytes == 0
    np.testing.assert_array_equal(window.estimate(), np.ones((L, E)))
    for step in range(1000):  # a report every 16 steps: 13 of the last 200 steps carry one
        window.add(np.ones((L, E), dtype=np.int64) if step % 16 == 0 else None)
    assert window.held_bytes == (13 + 1) * array_bytes  # the reports and their sum
    assert window.estimate()[0, 0] == 13 + 1
    for _ in range(200):
        window.add(None)
    assert window.held_bytes == 0 and window.estimate()[0, 0] == 1.0
