"""The EPLB load window: the expert load of the last `steps` committed steps, summed.

Ranks sum their load on the rank and report it every --load-report-every-steps steps, so a step
may carry no report at all (an idle cluster: none of them does). A step without a report holds
nothing here: what is kept is one `[L, E]` array per step of the window that carried load, and
their running sum, so the memory is bounded by the reports in the window, not by its steps (a
window of 200 steps of `[58, 1,024]` int64 was 95 MB, zeros or not). The estimate is the same
as summing every step's array: the steps without a report added zeros.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class LoadWindow:
    """`add(load)` once per committed step (`load`: [L, E] int64 tokens its reports carried, or None
    when no rank reported); `len()` is the steps in the window (at most `steps`); `estimate()` the
    [L, E] float64 load the EPLB rebalance and a restore read."""

    def __init__(self, steps: int, num_layers: int, num_experts: int):
        assert steps >= 1, f"a load window of {steps} steps"
        self.steps = steps
        self.shape = (num_layers, num_experts)
        self._added = 0  # steps added so far; a step's index is its count at its add
        self._reports: deque[tuple[int, np.ndarray]] = deque()  # (step index, [L, E]) of the steps with load
        self._total: np.ndarray | None = None  # [L, E] int64 sum of `_reports`; None while there are none

    def __len__(self) -> int:
        return min(self._added, self.steps)

    def add(self, load: np.ndarray | None) -> None:
        self._added += 1
        reports = self._reports
        while reports and reports[0][0] <= self._added - self.steps:  # out of the last `steps` steps
            _, old = reports.popleft()
            self._total -= old  # type: ignore[operator]
        if not reports:
            self._total = None  # nothing held between bursts of reports
        if load is None:
            return
        reports.append((self._added, load))
        if self._total is None:
            self._total = load.astype(np.int64)  # a copy: the sum never writes into a step's array
        else:
            self._total += load

    @property
    def held_bytes(self) -> int:
        """The arrays this window holds (the reports and their sum)."""
        total = 0 if self._total is None else self._total.nbytes
        return total + sum(load.nbytes for _, load in self._reports)

    def estimate(self) -> np.ndarray:
        """[L, E] tokens per expert over the window's steps, plus one so an unused expert still gets
        a slot; all ones when the window carried no load."""
        if self._total is not None and self._total.sum() > 0:
            return self._total.astype(np.float64) + 1.0
        return np.ones(self.shape)
