"""The background rebalance: the placement in use walked to a balanced one a few experts at a time,
between steps, while serving goes on.

Recovery and rejoin serve as soon as every expert has one live copy (the restore placement,
`placement/restore.py`), which leaves the load uneven: the lost rank's share falls on the
survivors that held the same experts, and a rejoined rank holds nothing. They then ask for a
rebalance; EPLB hands it the placement it chose. From the next step boundary on (once the
recovery's first step is done), every --rebalance-every-steps steps one move runs: an epoch
with the same members that keeps their process group (no rendezvous) and sets at most
--rebalance-move-bytes of slots to their target (`step_towards`: every expert keeps a copy in
between), copied peer to peer and verified slot by slot. Serving pauses only for that move.

A fault cancels the walk (the recovery asks for a new one over the survivors); a change of
members (a scale) makes it compute its target again. When the placement in use is the target,
the `rebalanced` event says how long it took, what moved and how its balance compares with a
placement computed from scratch over the same ranks and load.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from elastic_ep.placement.fault_aware import fault_aware_placement
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.placement.measures import balancedness
from elastic_ep.placement.restore import step_towards

from .events import EventKind
from .rebalance import eplb_due, plan_rebalance

if TYPE_CHECKING:
    from .controller import Controller


class BackgroundRebalance:
    def __init__(self, ctl: Controller):
        self.ctl = ctl
        self.cluster = ctl.cluster
        self.cfg = ctl.cfg
        self.reason: str | None = None  # why a walk is wanted; None: none
        self.target: ExpertLocation | None = None
        self.members: list[int] = []  # the members the target was computed for
        self.started_at = 0.0
        self.moves = 0
        self.slots_moved = 0
        self.bytes_moved = 0
        self.last_move_step = -1
        self.last_eplb_step = -1

    def request(self, reason: str) -> None:
        """Walk to a balanced placement over the current members, from the next boundary on."""
        self._start(reason, None)

    def status(self) -> dict[str, Any]:
        """For /cluster: whether a walk is under way, why, and how far it has come."""
        return {"active": self.reason is not None, "reason": self.reason, "moves": self.moves,
                "slots": self.slots_moved}

    def cancel(self) -> None:
        self.reason, self.target = None, None

    def check_eplb(self) -> None:
        """Every --eplb-interval steps: when the load is uneven enough, walk to EPLB's placement."""
        c, ctl = self.cluster, self.ctl
        if not (self.cfg.enable_eplb and eplb_due(c.step, self.cfg.eplb_interval, len(ctl.steps.load_window),
                                                  self.last_eplb_step)):
            return
        self.last_eplb_step = c.step
        assert c.location is not None
        plan = plan_rebalance(c.location, ctl.load(), c.members, c.rank_nodes(), self._speeds(), self.cfg.eplb_threshold)
        if plan is not None:
            ctl.metrics.eplb_rebalances.inc()
            self._start(f"eplb: imbalance {plan.before:.2f} -> {plan.after:.2f}", plan.placement)

    def due(self) -> bool:
        """A move is wanted and may run now: never during a scale; with requests in flight, not
        before a recovery's first step and only --rebalance-every-steps steps after the last
        move; with none, at once."""
        ctl = self.ctl
        if self.reason is None or ctl.scaling.active:
            return False
        if not ctl.scheduler.has_work:
            return True
        return ctl.recovery.record is None and self.cluster.step - self.last_move_step >= self.cfg.rebalance_every_steps

    def advance(self) -> None:
        """One move towards the target (computing the target first when there is none)."""
        c, ctl = self.cluster, self.ctl
        assert c.location is not None and self.reason is not None
        if self.target is None or self.members != c.members:
            self.target = fault_aware_placement(ctl.load(), c.members, c.rank_nodes(), self._speeds(),
                                                c.slots_per_rank, c.location.num_ranks, current=c.location)
            self.members = list(c.members)
        if c.location != self.target:
            max_slots = max(1, self.cfg.rebalance_move_bytes // ctl.reader.expert_nbytes)
            step = step_towards(c.location, self.target, max_slots, ctl.load())
            slots = int((step.phy2log != c.location.phy2log).sum())
            self.last_move_step = c.step
            ctl.form_epoch(c.members, f"{self.reason}: move {self.moves + 1}, {slots} slots", new=step,
                           reuse_group=True)
            self.moves += 1
            self.slots_moved += slots
            self.bytes_moved += slots * ctl.reader.expert_nbytes
        if c.location == self.target:
            self._finish()

    def _start(self, reason: str, target: ExpertLocation | None) -> None:
        self.reason, self.target, self.members = reason, target, list(self.cluster.members)
        self.started_at = time.monotonic()
        self.moves = self.slots_moved = self.bytes_moved = 0

    def _finish(self) -> None:
        c, ctl = self.cluster, self.ctl
        assert c.location is not None
        load, speeds = ctl.load(), self._speeds()
        scratch = fault_aware_placement(load, c.members, c.rank_nodes(), speeds, c.slots_per_rank,
                                        c.location.num_ranks)
        c.events.add(EventKind.REBALANCED, f"rebalanced ({self.reason}) in {self.moves} moves, "
                     f"{time.monotonic() - self.started_at:.2f}s", reason=self.reason, moves=self.moves,
                     slots=self.slots_moved, bytes=self.bytes_moved,
                     seconds=round(time.monotonic() - self.started_at, 4),
                     balancedness=round(float(balancedness(c.location, load, c.members, speeds).mean()), 4),
                     scratch_balancedness=round(float(balancedness(scratch, load, c.members, speeds).mean()), 4))
        self.cancel()

    def _speeds(self) -> dict[int, float] | None:
        """Measured speeds with --eplb-speed-aware and the straggler policy's derate weights."""
        return self.ctl.stragglers.placement_speeds()
