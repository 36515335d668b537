"""The readiness gate (--warmup-gate): /ready opens after the first epoch only once every rank ran
every batch shape of the step loop with a token on every one of its expert slots.

A GPU server captures a CUDA graph per decode batch size before it serves (vLLM captures sizes
1, 2, 4, 8, then steps of 8); here the place of that capture is one forward per shape: decode
batches of 1, 2, 4, ... up to --max-num-seqs tokens on a rank, and a full prefill chunk of
--max-num-batched-tokens. The step loop does not pad a step to these sizes (there is no graph to
replay on a CPU), so on a CPU they warm the allocator and kernels for those sizes and touch every
expert slot's weights once. Every (token, choice) of the warm-up goes round robin over the
group's slots (runtime/ep_moe.py: `ExpertParallelMoE.warm_up`), so each rank reports how many of
its slots computed, and the gate opens only when that is all of them on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_ep.wire import WarmedUp, WarmUp

from ..cluster import ClusterState
from ..control_plane import ControlPlane


def warmup_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Tokens per rank of each warm-up forward: powers of two up to max_num_seqs, max_num_seqs,
    and max_num_batched_tokens (a full prefill chunk), ascending, once each."""
    shapes = {max_num_seqs, max_num_batched_tokens}
    size = 1
    while size < max_num_seqs:
        shapes.add(size)
        size *= 2
    return sorted(s for s in shapes if s > 0)


@dataclass
class WarmUpReport:
    """What the gate saw: shapes asked, slots per rank, per rank the slots that computed and the
    shapes it ran, the slowest rank's seconds, and the errors ("" when complete)."""

    shapes: list[int]
    slots: int
    slots_warmed: dict[int, int] = field(default_factory=dict)
    shapes_run: dict[int, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    problem: str = ""

    @property
    def complete(self) -> bool:
        return not self.problem

    def view(self) -> dict[str, Any]:
        return {"shapes": self.shapes, "slots_per_rank": self.slots, "slots_warmed": self.slots_warmed,
                "seconds": self.seconds, "complete": self.complete, "problem": self.problem}


class WarmUpGate:
    """`pump(timeout_s)` handles input meanwhile (replies come through `on_reply`); `faulted(ranks)`
    tells whether a member has a pending fault (the wait ends: recovery takes over)."""

    def __init__(self, cluster: ClusterState, plane: ControlPlane, shapes: list[int], timeout_s: float,
                 pump: Callable[[float], None], faulted: Callable[[list[int]], bool]):
        self.cluster, self.plane, self.shapes, self.timeout_s = cluster, plane, shapes, timeout_s
        self.pump, self.faulted = pump, faulted
        self.replies: dict[int, WarmedUp] = {}
        self.report: WarmUpReport | None = None

    def on_reply(self, msg: WarmedUp) -> None:
        if msg.epoch == self.cluster.epoch:
            self.replies[msg.rank_id] = msg

    def run(self) -> WarmUpReport:
        """Warm the members of the current epoch up; the report says whether every slot of every
        rank computed in every shape (`complete`)."""
        c = self.cluster
        members = list(c.members)
        report = self.report = WarmUpReport(self.shapes, c.slots_per_rank * c.num_layers)
        self.replies = {}
        for rank_id in members:
            self.plane.to_worker(rank_id, WarmUp(c.epoch, self.shapes))
        deadline = time.monotonic() + self.timeout_s
        while len(self.replies) < len(members):
            if self.faulted(members):
                report.problem = "a member failed during the warm-up"
                return report
            if time.monotonic() > deadline:
                report.problem = f"ranks {sorted(set(members) - set(self.replies))} did not finish the warm-up"
                return report
            self.pump(0.005)
        for rank_id, msg in sorted(self.replies.items()):
            report.slots_warmed[rank_id], report.shapes_run[rank_id] = msg.slots_warmed, msg.shapes
        report.seconds = max(m.seconds for m in self.replies.values())
        problems = [f"rank {m.rank_id}: {m.error}" for m in self.replies.values() if m.error]
        problems += [f"rank {r}: {n} of {report.slots} slots computed" for r, n in report.slots_warmed.items()
                     if n < report.slots]
        problems += [f"rank {r}: ran shapes {s}" for r, s in report.shapes_run.items() if s != self.shapes]
        report.problem = "; ".join(problems)
        return report
