"""Poison isolation: one bad request harms only itself.

A step can fail with every rank alive: a rank's own computation raised (`StepFailed` of kind
LOCAL: a request that breaks attention, a shape only it produces in the experts, its sampling).
The rank still ran every collective of the step, so the group is whole: nothing is fenced and
no epoch changes. The step's results are dropped (a LOCAL failure in the experts sent zeros to
every rank) and the step is run again without the suspects, which are found by group testing:

- the suspects are the failed step's sequences on the failing ranks (all of the step's when
  the failure was in the experts), less those already proven innocent in this round;
- a control step runs everyone else: if it fails too with nothing left to blame, the rank
  itself is broken and becomes a fault (it fails every batch), as before this module existed;
- then halves of the set known to hold a culprit run beside everyone else until one sequence
  fails alone: only it ends, with an error that says why; the rest are tested at once.

Every test step is a real step that also advances the innocent requests; a round is bounded by
`max_steps`, after which the remaining suspects end with an error. Sampling errors of single
rows never get here: the worker samples the other rows and names the failed one.
"""

from __future__ import annotations

from collections.abc import Callable

from elastic_ep.wire import StepFailed

from ..events import EventKind, EventLog
from ..faults.detector import Fault, FaultCause
from .scheduler import StepBatch
from .streams import Streams


class Isolation:
    """`fault(Fault)` names a broken rank. `held` is what the scheduler leaves out of the next step."""

    def __init__(self, streams: Streams, events: EventLog, fault: Callable[[Fault], None], max_steps: int):
        self.streams = streams
        self.events = events
        self.fault = fault
        self.max_steps = max_steps
        self.suspects: set[int] = set()
        self.testing: set[int] = set()
        self.narrowed: set[int] = set()  # suspects known to hold a culprit
        self.cleared: set[int] = set()  # ran in a step that passed, this round
        self.steps = 0
        self.isolated = 0  # requests ended so far

    @property
    def held(self) -> set[int]:
        return self.suspects - self.testing

    def step_passed(self, batch: StepBatch) -> None:
        if not self.suspects:
            return
        self.steps += 1
        self.cleared |= batch.seq_ids()
        self.suspects -= self.testing
        self.narrowed -= self.testing
        self._next_test()

    def step_failed(self, step: int, batch: StepBatch, failures: dict[int, StepFailed]) -> None:
        """A step whose ranks failed LOCAL: narrow the suspects, end a culprit found alone, or
        name a rank that failed with nothing to blame."""
        self.steps += 1
        in_experts = any(f.in_experts for f in failures.values())
        candidates = batch.seq_ids() if in_experts else {q for r in failures for q in batch.seq_ids_on(r)}
        candidates -= self.cleared
        detail = "; ".join(f"rank {r}: {f.error}" for r, f in sorted(failures.items()))
        if not candidates:
            for rank_id, f in failures.items():
                self.fault(Fault(rank_id, FaultCause.STEP_ERRORS,
                                 f"fails its steps with no request to blame: {f.error}"))
            self._end_round()
            return
        tested = candidates & self.testing
        if len(tested) == 1 and tested == self.testing:
            self._end(tested.pop(), step, detail)
        elif tested:
            self.narrowed = tested
        else:  # the failure came from sequences that were not suspects: run a control step
            self.suspects |= candidates
            self.narrowed = set(candidates)
            self.testing = set()
            self._check_bound(detail)
            return
        self._next_test()
        self._check_bound(detail)

    def reset(self) -> None:
        """A fault changed the epoch: the round starts over if the failure comes back."""
        self._end_round()

    def _next_test(self) -> None:
        """Test half of the narrowed set, else every remaining suspect at once."""
        if self.narrowed:
            ordered = sorted(self.narrowed)
            self.testing = set(ordered[: max(1, len(ordered) // 2)])
        elif self.suspects:
            self.testing = set(self.suspects)
        else:
            self._end_round()

    def _end(self, seq_id: int, step: int, detail: str) -> None:
        self.streams.end_with_error(seq_id, f"this request made step {step} fail ({detail}); it was ended so "
                                            "the other requests go on")
        self.isolated += 1
        self.events.add(EventKind.REQUEST_ERROR, f"isolated the request that failed step {step}: {detail}",
                        seq_id=seq_id, steps=self.steps)
        self.suspects.discard(seq_id)
        self.narrowed = set()

    def _check_bound(self, detail: str) -> None:
        if self.steps < self.max_steps:
            return
        for seq_id in sorted(self.suspects):
            self.streams.end_with_error(seq_id, f"steps kept failing and this request could not be cleared within "
                                                f"{self.max_steps} steps ({detail})")
        self.events.add(EventKind.REQUEST_ERROR, f"ended {len(self.suspects)} suspect requests after "
                        f"{self.max_steps} steps of isolation: {detail}")
        self._end_round()

    def _end_round(self) -> None:
        self.suspects, self.testing, self.narrowed, self.cleared = set(), set(), set(), set()
        self.steps = 0
