"""Which step plan a worker runs, holds or drops, whichever way its plans come.

With --step-plans-via agent a rank's plans come through its node's agent (`NodeStepPlans`) while
`EpochStart`, `ResendResult`, `WarmUp` and the rest come on the step socket: the two paths are not
ordered with each other, so a plan may arrive before the `EpochStart` of its epoch, and a plan the
agent held up (a stalled agent that resumed) may arrive after the controller gave up on its step.
The rules, for plans of either path:
- a plan of the epoch the rank is in runs, once: (epoch, step) must be past the last it ran or
  answered NOT_RUN for (`passed`): a plan never runs twice, and never after the rank told the
  controller it had not run that step (the controller recomputes that step in a new epoch);
- a plan of a later epoch than the rank's is held until that epoch starts (`release`), at most
  `MAX_HELD_PLANS` of them, the oldest dropped first;
- a plan of an earlier epoch is dropped, and so are held plans of an epoch the rank left behind.
Steps are numbered by the controller across epochs; a new leader numbers its own, so following
one starts the order afresh (`reset`).
"""

from __future__ import annotations

from enum import Enum

from elastic_ep.wire import StepPlan

# The controller sends a rank's next plan only after every member answered the last one (with serve
# --send-ahead-steps, one more of the same epoch, which runs when it is read: never held here), so one
# plan of a coming epoch is all that can wait legitimately; a few more allow for a reordering of the
# two paths, and anything past that is stale.
MAX_HELD_PLANS = 4


class Verdict(str, Enum):
    RUN = "run"
    HOLD = "hold"
    DROP = "drop"


class PlanOrder:
    """`admit(plan, epoch)`: what to do with a plan arriving while the rank is in `epoch` (-1: none);
    `ran(plan)` once it ran; `passed(epoch, step)` when the rank answered that it never ran it;
    `release(epoch)`: the held plans of `epoch`, in step order, once the rank is in it."""

    def __init__(self) -> None:
        self.last: tuple[int, int] = (-1, -1)  # (epoch, step) last run or answered NOT_RUN
        self.held: list[StepPlan] = []

    def admit(self, plan: StepPlan, epoch: int) -> Verdict:
        if (plan.epoch, plan.step) <= self.last or plan.epoch < epoch:
            return Verdict.DROP
        if plan.epoch == epoch:
            return Verdict.RUN
        if all((h.epoch, h.step) != (plan.epoch, plan.step) for h in self.held):
            self.held.append(plan)
            self.held.sort(key=lambda h: (h.epoch, h.step))
            del self.held[:-MAX_HELD_PLANS]
        return Verdict.HOLD

    def ran(self, plan: StepPlan) -> None:
        self.passed(plan.epoch, plan.step)

    def passed(self, epoch: int, step: int) -> None:
        """No plan of (epoch, step) or before runs from now on; held ones are dropped."""
        self.last = max(self.last, (epoch, step))
        self.held = [h for h in self.held if (h.epoch, h.step) > self.last]

    def release(self, epoch: int) -> list[StepPlan]:
        """The held plans of `epoch` (taken out), oldest first; held plans of earlier epochs are dropped."""
        out = [h for h in self.held if h.epoch == epoch]
        self.held = [h for h in self.held if h.epoch > epoch]
        return out

    def reset(self) -> None:
        """A new leader: its epochs and steps are numbered afresh."""
        self.last, self.held = (-1, -1), []
