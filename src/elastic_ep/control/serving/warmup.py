"""The readiness gate (--warmup-gate): /ready opens after the first epoch only once every rank ran
every batch shape of the step loop with a token on every one of its expert slots; a later epoch
serves once what it changed is warm: the slots it filled and the shapes a member has not run.

A GPU server captures a CUDA graph per batch size before it serves (vLLM captures sizes 1, 2, 4,
8, then steps of 8) and pads each step to the next captured size; here the place of that capture
is one forward per shape: 1, 2, 4, ... tokens on a rank up to --max-num-batched-tokens (a full
prefill chunk), with --max-num-seqs among them. The step loop runs only these shapes: each rank's
tokens are padded to the next one (`padded_tokens`; a rank with nothing to run runs the smallest,
as vLLM's idle data-parallel ranks run a dummy batch), on the CPU as on a GPU, so the first run of
a shape is always the warm-up's. Every (token, choice) of the warm-up goes round robin over the
group's slots (runtime/ep_moe.py: `ExpertParallelMoE.warm_up`), so each rank reports how many of
its slots computed, and the gate opens only when that is all of them on every rank. With
--enable-dbo a step runs its rank's tokens in two micro-batches (`runtime/overlap.py`), so each
shape is warmed in two micro-batches too, and in one as well where a step can still run one
(`warmup_steps`). An epoch change moves experts into slots, so each new epoch is warmed before it
serves (a failed warm-up is recovered from as a failed epoch is), but only what changed: each
rank runs every slot it filled once on its own as the epoch forms (runtime/warmth.py; `EpochReady`
says how many), and the gate's forwards, which every member must run together (each is an
all-to-all of the group), run only the shapes some member has not run in its process
(`steps_to_warm`: none after a loss, all of them when a new process joins). `ShapeTally` counts
the shape of every step each rank ran, and the steps that ran a (shape, micro-batches) their
epoch did not warm.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_ep.wire import EpochReady, WarmedUp, WarmUp

from ..cluster import ClusterState
from ..control_plane import ControlPlane


def warmup_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Tokens per rank of each warm-up forward: powers of two below max_num_batched_tokens,
    max_num_seqs and max_num_batched_tokens (a full prefill chunk), ascending, once each (a step
    padded to the next one runs less than twice its tokens)."""
    shapes = {max_num_seqs, max_num_batched_tokens}
    size = 1
    while size < max_num_batched_tokens:
        shapes.add(size)
        size *= 2
    return sorted(s for s in shapes if 0 < s <= max_num_batched_tokens)


def warmup_steps(shapes: list[int], dbo_min_tokens: int | None) -> list[tuple[int, int]]:
    """(tokens, micro-batches) of every step a rank can run, `shapes` ascending. Without
    --enable-dbo (dbo_min_tokens None) each shape in one micro-batch. With it a step whose busiest
    rank runs at least dbo_min_tokens (padding included) runs two on every rank, a smaller or idle
    rank's shape included, so every shape in two; a step where every rank runs fewer runs one, so
    the shapes below dbo_min_tokens in one as well."""
    if dbo_min_tokens is None:
        return [(s, 1) for s in shapes]
    two = [(s, 2) for s in shapes] if shapes and shapes[-1] >= dbo_min_tokens else []
    return sorted([(s, 1) for s in shapes if s < dbo_min_tokens] + two)


def steps_to_warm(steps: list[tuple[int, int]], runs: list[set[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The (tokens, micro-batches) of `steps` that a group's forwards must run: those at least one
    member (`runs`: per member, the steps its process ran) has not, in the order of `steps`. A
    member that has run one runs it again with the others: the forward is collective."""
    return [step for step in steps if any(step not in ran for ran in runs)]


def padded_tokens(tokens: int, shapes: list[int]) -> int:
    """The shape a rank with `tokens` tokens in a step runs: the smallest of `shapes` (ascending)
    that holds them; `tokens` itself above the largest (the scheduler never plans that many)."""
    i = bisect.bisect_left(shapes, max(tokens, 1))
    return shapes[i] if i < len(shapes) else tokens


@dataclass
class ShapeTally:
    """Steps per shape (tokens a rank's forward ran, padding included) and per number of
    micro-batches over every rank, and how many of them ran a (shape, micro-batches) that the
    warm-up of their epoch did not (`unwarmed`: 0 when the gate covers every step)."""

    steps: Counter = field(default_factory=Counter)
    micro_batches: Counter = field(default_factory=Counter)
    unwarmed: int = 0

    def add(self, shape: int, micro_batches: int, warmed: bool, ranks: int = 1) -> None:
        """`ranks` ranks ran a step of `shape` tokens in `micro_batches`."""
        self.steps[shape] += ranks
        self.micro_batches[micro_batches] += ranks
        self.unwarmed += 0 if warmed else ranks

    def view(self) -> dict[str, Any]:
        return {"steps_by_shape": {str(k): v for k, v in sorted(self.steps.items())},
                "steps_by_micro_batches": {str(k): v for k, v in sorted(self.micro_batches.items())},
                "unwarmed_steps": self.unwarmed}


@dataclass
class WarmUpReport:
    """What the gate saw: the forwards asked (tokens of each, and its micro-batches; none when every
    member has run every shape), slots per rank, the slots the epoch filled and those its ranks
    ran on their own as it formed (`EpochReady.slots_warmed`, summed), per rank the slots that
    computed in the forwards and the shapes it ran, the slowest rank's seconds, and the errors
    ("" when complete)."""

    shapes: list[int]
    micro_batches: list[int]
    slots: int
    slots_filled: int = 0
    filled_slots_warmed: int = 0
    slots_warmed: dict[int, int] = field(default_factory=dict)
    shapes_run: dict[int, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    problem: str = ""

    @property
    def complete(self) -> bool:
        return not self.problem

    def view(self) -> dict[str, Any]:
        return {"shapes": self.shapes, "micro_batches": self.micro_batches, "slots_per_rank": self.slots,
                "slots_filled": self.slots_filled, "filled_slots_warmed": self.filled_slots_warmed,
                "slots_warmed": self.slots_warmed,
                "seconds": self.seconds, "complete": self.complete, "problem": self.problem}


class WarmUpGate:
    """`pump(timeout_s)` handles input meanwhile (replies come through `on_reply`); `faulted(ranks)`
    tells whether a member has a pending fault (the wait ends: recovery takes over). `shapes`:
    tokens per rank the step loop pads to; dbo_min_tokens: --dbo-min-tokens with --enable-dbo
    (None without), which decides the micro-batches each shape is warmed in (`warmup_steps`).
    `epoch`: the last epoch whose warm-up completed (-1: none yet); `ran` tallies the shape of each
    step a rank ran. `every_step`: run every shape on every member in every epoch, what each
    member has run regardless (the rule before warming only what changed; benchmarks/control_plane.py
    --warm-all measures the two side by side)."""

    def __init__(self, cluster: ClusterState, plane: ControlPlane, shapes: list[int], timeout_s: float,
                 pump: Callable[[float], None], faulted: Callable[[list[int]], bool],
                 dbo_min_tokens: int | None = None):
        self.cluster, self.plane, self.shapes, self.timeout_s = cluster, plane, shapes, timeout_s
        self.steps = warmup_steps(shapes, dbo_min_tokens)
        self._warmed_steps = set(self.steps)
        self.pump, self.faulted = pump, faulted
        self.replies: dict[int, WarmedUp] = {}
        self.report: WarmUpReport | None = None
        self.first: WarmUpReport | None = None  # the first that completed: the cold start's, every shape
        self.epoch = -1
        self.tally = ShapeTally()
        self.every_step = False

    def on_reply(self, msg: WarmedUp) -> None:
        if msg.epoch == self.cluster.epoch:
            self.replies[msg.rank_id] = msg

    def adopted(self, epoch: int) -> None:
        """`epoch` adopts the ranks of the last leader, which warmed them up: their shapes count as warmed."""
        self.epoch = epoch

    def ran(self, epoch: int, shape: int, micro_batches: int, ranks: int = 1) -> None:
        """`ranks` ranks ran a step of `epoch` with `shape` tokens (padding included) in `micro_batches`."""
        self.tally.add(shape, micro_batches, epoch == self.epoch and (shape, micro_batches) in self._warmed_steps,
                       ranks)

    def view(self) -> dict[str, Any] | None:
        """The first complete warm-up's report (the cold start's: every shape, every slot), the last
        one's (`last`), the epoch last warmed, and the shapes the steps ran (None before any)."""
        if self.report is None:
            return None
        return {**(self.first or self.report).view(), "epoch": self.epoch, "last": self.report.view(),
                **self.tally.view()}

    def run(self, ready: dict[int, EpochReady], filled: dict[int, int]) -> WarmUpReport:
        """Warm what the current epoch changed: `ready` holds each member's `EpochReady` (the slots
        it ran as the epoch formed, the shapes its process has run), `filled` the slots the
        epoch filled per rank. The report says whether every rank ran each slot it filled and,
        when forwards ran, whether every slot of every rank computed in each (`complete`)."""
        c = self.cluster
        members = list(c.members)
        runs = [{tuple(step) for step in ready[r].steps_run} for r in members]
        steps = self.steps if self.every_step else steps_to_warm(self.steps, runs)
        tokens, micro_batches = [t for t, _ in steps], [m for _, m in steps]
        report = self.report = WarmUpReport(tokens, micro_batches, c.slots_per_rank * c.num_layers,
                                            sum(filled.values()), sum(ready[r].slots_warmed for r in members))
        unwarmed = [f"rank {r}: ran {ready[r].slots_warmed} of the {n} slots it filled" for r, n in filled.items()
                    if r in ready and ready[r].slots_warmed < n]
        report.seconds = max((ready[r].warm_s for r in members), default=0.0)
        if not steps:
            report.problem = "; ".join(unwarmed)
            return self._completed(report)
        self.replies = {}
        for rank_id in members:
            self.plane.to_worker(rank_id, WarmUp(c.epoch, tokens, micro_batches))
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
        report.seconds += max(m.seconds for m in self.replies.values())
        problems = unwarmed + [f"rank {m.rank_id}: {m.error}" for m in self.replies.values() if m.error]
        problems += [f"rank {r}: {n} of {report.slots} slots computed" for r, n in report.slots_warmed.items()
                     if n < report.slots]
        problems += [f"rank {r}: ran shapes {s}" for r, s in report.shapes_run.items() if s != tokens]
        report.problem = "; ".join(problems)
        return self._completed(report)

    def _completed(self, report: WarmUpReport) -> WarmUpReport:
        if report.complete:
            self.epoch = self.cluster.epoch
            self.first = self.first or report
        return report
