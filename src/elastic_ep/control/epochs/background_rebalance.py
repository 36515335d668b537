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

From `OFF_THREAD_RANKS` members on, the target and that placement from scratch are computed off
the control thread (`compute`: the worker process of the restores computed ahead; `off_thread.py`),
and the walk is not due until they are: at 1,024 ranks they took 6-10 s each, during which the
control thread read no heartbeat and named no fault. EPLB's check at its interval (its plan and
the placement from scratch) goes the same way; its walk starts at the first boundary after it is
there, if the epoch it was planned in still serves. Below, a few ms: computed here.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from elastic_ep.placement.location import ExpertLocation
from elastic_ep.placement.measures import balancedness
from elastic_ep.placement.restore import step_towards

from ..cluster import ClusterState
from ..config import ServeConfig
from ..events import EventKind
from ..metrics import ClusterMetrics
from .epoch_change import EpochReport, NoPlacement
from .off_thread import OffThread
from .rebalance_rules import eplb_due, eplb_plan, rebalance_targets
from .requests import EpochRequest, Move


class BackgroundRebalance:
    """Built with the cluster state, an expert's bytes, the metrics, and the callables `load()`
    (the recent expert load [L, E]), `load_steps()` (steps in that window), `speeds()` (placement
    speed weights, or None), `form(EpochRequest, reason)` (the loop's epoch change),
    `scaling()` (a scale is in flight), `has_work()` (requests in flight), `recovering()` (a
    recovery has not yet completed its first step) and `compute(fn, *args)` (a Future of `fn(*args)`
    off the control thread; None: every target computed here)."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, expert_nbytes: int, metrics: ClusterMetrics, *,
                 load: Callable[[], np.ndarray], load_steps: Callable[[], int],
                 speeds: Callable[[], dict[int, float] | None],
                 form: Callable[[EpochRequest, str], EpochReport | NoPlacement], scaling: Callable[[], bool],
                 has_work: Callable[[], bool], recovering: Callable[[], bool],
                 compute: Callable[..., cf.Future] | None = None):
        self.cluster = cluster
        self.cfg = cfg
        self.expert_nbytes = expert_nbytes
        self.metrics = metrics
        self.load = load
        self.load_steps = load_steps
        self._speeds = speeds
        self.form = form
        self.scaling = scaling
        self.has_work = has_work
        self.recovering = recovering
        self.targets = OffThread(compute)  # the target for the members of now
        self.eplb = OffThread(compute)  # EPLB's check, for the epoch it was asked in
        self.scratch: ExpertLocation | None = None  # the placement from scratch the target is judged against
        self.reason: str | None = None  # why a walk is wanted; None: none
        self.target: ExpertLocation | None = None
        self.members: list[int] = []  # the members the target was computed for
        self.target_load: np.ndarray | None = None  # [layers, experts]: the load it was computed for
        self.started_at = 0.0
        self.moves = 0
        self.slots_moved = 0
        self.bytes_moved = 0
        self.last_move_step = -1
        self.last_eplb_step = -1

    def request(self, reason: str) -> None:
        """Walk to a balanced placement over the current members, from the next boundary on."""
        self._start(reason)

    def status(self) -> dict[str, Any]:
        """For /cluster: whether a walk is under way, why, and how far it has come."""
        return {"active": self.reason is not None, "reason": self.reason, "moves": self.moves,
                "slots": self.slots_moved}

    def cancel(self) -> None:
        self._reset()
        self.targets.cancel()  # what it computes is not waited for

    def check_eplb(self) -> None:
        """Every --eplb-interval steps (not while its last check is computed): EPLB's plan; when it
        is there (at once below OFF_THREAD_RANKS) and the load was uneven enough, walk to it."""
        c = self.cluster
        if (self.cfg.enable_eplb and not self.eplb.busy
                and eplb_due(c.step, self.cfg.eplb_interval, self.load_steps(), self.last_eplb_step)):
            assert c.location is not None
            self.last_eplb_step = c.step
            self.eplb.start(c.epoch, len(c.members), eplb_plan, c.location, self.load(), list(c.members),
                            c.rank_nodes(), self._speeds(), self.cfg.eplb_threshold)
        done = self.eplb.take(c.epoch)  # planned in another epoch: dropped
        if done is None or done.value[0] is None:
            return
        plan, scratch = done.value
        self.metrics.eplb_rebalances.inc()
        self._start(f"eplb: imbalance {plan.before:.2f} -> {plan.after:.2f}", plan.placement, scratch,
                    done.args[1])  # the load it was planned for

    def due(self) -> bool:
        """A move is wanted and may run now: never during a scale; with requests in flight, not
        before a recovery's first step and only --rebalance-every-steps steps after the last
        move; with none, at once."""
        if self.reason is None or self.scaling():
            return False
        if self.targets.busy:
            return False
        if not self.has_work():
            return True
        return not self.recovering() and self.cluster.step - self.last_move_step >= self.cfg.rebalance_every_steps

    def advance(self) -> None:
        """One move towards the target (computing the target first when there is none: off the control
        thread, no move until it is there)."""
        c = self.cluster
        assert c.location is not None and self.reason is not None
        if (self.target is None or self.members != c.members) and not self._take_target():
            return
        if c.location != self.target:
            max_slots = max(1, self.cfg.rebalance_move_bytes // self.expert_nbytes)
            step = step_towards(c.location, self.target, max_slots, self.load())
            slots = int((step.phy2log != c.location.phy2log).sum())
            self.last_move_step = c.step
            self.form(Move(step), f"{self.reason}: move {self.moves + 1}, {slots} slots")
            self.moves += 1
            self.slots_moved += slots
            self.bytes_moved += slots * self.expert_nbytes
        if c.location == self.target:
            self._finish()

    def _take_target(self) -> bool:
        """The target for the current members: computed here, or taken from its computation off the
        control thread once done (started now when there is none for these members). False: not yet."""
        c = self.cluster
        assert c.location is not None
        members = tuple(c.members)
        if not self.targets.asked(members):
            self.targets.start(members, len(members), rebalance_targets, self.load(), list(members), c.rank_nodes(),
                               self._speeds(), c.slots_per_rank, c.location.num_ranks, c.location)
        done = self.targets.take(members)
        if done is None:
            return False
        self.members, self.target_load = list(members), done.args[0]
        self.target, self.scratch = done.value
        return True

    def _start(self, reason: str, target: ExpertLocation | None = None, scratch: ExpertLocation | None = None,
               load: np.ndarray | None = None) -> None:
        """A walk for `reason` to `target` (None: computed for the members at the first move), judged
        at its end against `scratch` under `load`, what `target` was computed from."""
        self.cancel()
        self.reason, self.target, self.scratch, self.target_load = reason, target, scratch, load
        self.members = list(self.cluster.members)
        self.started_at = time.monotonic()

    def _reset(self) -> None:
        self.reason, self.target, self.target_load, self.scratch = None, None, None, None
        self.moves = self.slots_moved = self.bytes_moved = 0

    def _finish(self) -> None:
        # Both figures under the load the target was computed for: the walk is judged against a
        # placement made from scratch for the same load and members (computed with the target,
        # off the thread), not against a load that moved since.
        c = self.cluster
        assert c.location is not None and self.target_load is not None and self.scratch is not None
        speeds, seconds = self._speeds(), round(time.monotonic() - self.started_at, 4)
        c.events.add(EventKind.REBALANCED, f"rebalanced ({self.reason}) in {self.moves} moves, {seconds:.2f}s",
                     reason=self.reason, moves=self.moves, slots=self.slots_moved, bytes=self.bytes_moved,
                     seconds=seconds,
                     balancedness=round(float(balancedness(c.location, self.target_load, c.members, speeds).mean()), 4),
                     scratch_balancedness=round(float(balancedness(self.scratch, self.target_load, c.members,
                                                                   speeds).mean()), 4))
        self.cancel()
