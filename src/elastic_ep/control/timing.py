"""Where the control thread's time goes: perf_counter sums per part of a step and per kind of
message handled, cheap enough to stay on (a clock read per part), read by
benchmarks/control_plane.py and shown in `/cluster` (`control_times`).

A step's parts: plan (the scheduler and the plans), encode and send (every member's plan),
gather (from the last send until every member answered: the ranks' time, the transport, and
whatever the control thread did meanwhile), decode (the results' frames), commit (tokens to the
scheduler and the streams) and metrics (what the step before's answers tell the timings, the
straggler intervals, the EPLB window and the metrics: `StepLoop.observe`, run once the next step's
plans went out, so inside that step's gather, not after the commit); prepare (--async-scheduling:
the next step planned and sealed while this one runs, inside the gather's time too); between (from a
step's completion to the next step's start, when the step before completed: what the control thread
does at a step boundary, its pump and decisions). `slowest_rank_s` sums the slowest member's own
`step_s` per step, so `wall_s - slowest_rank_s` is what the control plane added within the steps
(`between` is outside them), and commit + between + plan + encode + send is the control thread's own
part of the wait from one step's last answer to the next step's plans.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

STEP_PARTS = ("plan", "encode", "send", "gather", "decode", "commit", "metrics", "prepare", "between")


@dataclass
class ControlTimes:
    steps: int = 0
    wall_s: float = 0.0
    slowest_rank_s: float = 0.0
    part_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))
    handled_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # message type -> seconds
    handled: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # message type -> count
    frames_in: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # socket -> frames
    bytes_in: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # socket -> bytes
    decode_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # socket -> seconds
    bytes_out: int = 0
    # step plans sent: "direct" (to a rank) and "relayed" (in a node's frame to its agent, --step-plans-via agent)
    plans_out: dict[str, int] = field(default_factory=lambda: {"direct": 0, "relayed": 0})
    snapshot_s: float = 0.0  # the last /cluster snapshot's build, its gauges included

    def add(self, part: str, seconds: float) -> None:
        self.part_s[part] += seconds

    def view(self) -> dict:
        """Totals since start, milliseconds per step for the step parts."""
        n = max(self.steps, 1)
        return {
            "steps": self.steps,
            "ms_per_step": {p: round(1000 * s / n, 3)
                            for p, s in {**self.part_s, "decode": self.decode_s["step"]}.items()},
            "added_ms_per_step": round(1000 * (self.wall_s - self.slowest_rank_s) / n, 3),
            "handled_s": {k: round(v, 4) for k, v in self.handled_s.items()},
            "handled": dict(self.handled),
            "frames_in": dict(self.frames_in),
            "bytes_in": dict(self.bytes_in),
            "bytes_out": self.bytes_out,
            "plans_out": dict(self.plans_out),
            "snapshot_ms": round(1000 * self.snapshot_s, 3),
        }
