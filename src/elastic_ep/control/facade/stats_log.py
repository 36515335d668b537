"""The periodic one-line stats log, as vLLM prints it: throughput, running and waiting requests,
epoch, serving ranks and readiness, every --log-stats-interval-s on the `elastic_ep.stats`
logger (INFO). An idle cluster logs one idle line, then nothing until something changes.
`Throughput` is the same rates over the last seconds, for `/cluster` (`load`) and the dashboard.
"""

from __future__ import annotations

import logging
from collections import deque

from ..api import Readiness
from ..cluster import ClusterState
from ..ranks import RankStatus

logger = logging.getLogger("elastic_ep.stats")


class Throughput:
    """Steps, tokens run and tokens generated per second over the last `window_s`, from the
    cumulative counts handed to `add` (times: seconds, any monotonic clock)."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._samples: deque[tuple[float, tuple[int, int, int]]] = deque()

    def add(self, now: float, counts: tuple[int, int, int]) -> None:
        """counts: (steps, tokens run, tokens generated) since start."""
        self._samples.append((now, counts))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rates(self) -> dict[str, float | None]:
        """{steps_per_s, tokens_per_s, generated_tokens_per_s}; None before two samples."""
        names = ("steps_per_s", "tokens_per_s", "generated_tokens_per_s")
        if len(self._samples) < 2 or self._samples[-1][0] <= self._samples[0][0]:
            return dict.fromkeys(names)
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        return {name: round((b - a) / (t1 - t0), 1) for name, a, b in zip(names, first, last, strict=True)}


class StatsLog:
    """interval_s: seconds between lines (0 or less: never); now: monotonic start time."""

    def __init__(self, interval_s: float, now: float):
        self.interval_s = interval_s
        self._at = now
        self._counts = (0, 0, 0)  # steps, tokens run, tokens sampled at the last line
        self._last: tuple | None = None  # (idle, epoch, serving, members, readiness) of the last line

    def due(self, now: float) -> bool:
        """Whether `maybe_log` would write a line now (its arguments need not be counted otherwise)."""
        return self.interval_s > 0 and now - self._at >= self.interval_s

    def maybe_log(self, now: float, c: ClusterState, counts: tuple[int, int, int], running: int, waiting: int,
                  readiness: Readiness) -> None:
        """counts: steps, tokens run and tokens sampled so far; running, waiting: requests now."""
        if not self.due(now):
            return
        d_steps, d_run, d_sampled = (b - a for a, b in zip(self._counts, counts, strict=True))
        elapsed_s = now - self._at
        self._at, self._counts = now, counts
        serving = sum(1 for r in c.members if c.ranks[r].status == RankStatus.SERVING)
        idle = d_steps == 0 and running == 0 and waiting == 0
        state = (idle, c.epoch, serving, len(c.members), readiness)
        if idle and state == self._last:
            return
        self._last = state
        fields = {"steps_per_s": round(d_steps / elapsed_s, 2), "tokens_per_s": round(d_run / elapsed_s, 1),
                  "generated_tokens_per_s": round(d_sampled / elapsed_s, 1), "running": running, "waiting": waiting,
                  "epoch": c.epoch, "serving_ranks": serving, "members": len(c.members), "ready": readiness.ready}
        logger.info(
            "stats: %.1f steps/s, %.1f tokens/s run (prefill + decode), %.1f tokens/s generated; running %d, "
            "waiting %d requests; epoch %d, %d/%d ranks serving; %s", fields["steps_per_s"], fields["tokens_per_s"],
            fields["generated_tokens_per_s"], running, waiting, c.epoch, serving, len(c.members),
            "ready" if readiness.ready else f"not ready: {readiness.reason}", extra={"fields": fields})
