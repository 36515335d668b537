"""The fault detector: every detection signal in, a typed `Fault(rank_id, cause, detail)` out.

Signals, fastest first: the agent reports a worker's exit (crash, OOM kill, `kill -9`); a worker
reports that a collective raised (gloo fails in milliseconds when a peer's socket closes, with
no rank to blame: an error, not a fault; an error in a rank's own computation is not even that,
see control/serving/isolation.py); a rank's heartbeats stop for --heartbeat-timeout-s (a
stopped process or a cut link; heartbeats come from their own thread, so a rank blocked in a
collective or merely slow keeps beating); they come in their agent's `NodeHeartbeat`, each with
its age at the agent, and count as heard at arrival less that age: a stopped rank's age grows
and its heard time stays where it was, and a silent agent's ranks are heard from no more (its
own deadline, --agent-timeout-s, fires too); the progress watchdog names a rank that has not
entered the collective the others wait in for the adaptive deadline (a hang). A slow rank is
never a fault here: it enters each collective late but within a deadline that grows with the
step times it causes. The rules themselves are the pure functions of `control/faults/health_rules.py`.

What is found stays pending until recovery takes it (`take`); the control loop checks
`pending` after every wait and turns it into `RecoveryNeeded`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from elastic_ep.wire import NodeHeartbeat, Progress, exit_reason

from ..config import ServeConfig
from ..ranks import RankInfo
from .health_rules import LOADING_PHASES, adaptive_deadline_s, hung_ranks, lost_heartbeats


class RecoveryNeeded(Exception):
    """Raised inside the control loop when a fault interrupts a step or an epoch change."""


class FaultCause(str, Enum):
    """Why a rank was named; the value is the `cause` label of the recoveries metric."""

    EXITED = "exited"  # its agent saw the process exit
    HEARTBEAT_LOST = "heartbeat"  # no heartbeat for --heartbeat-timeout-s
    HUNG = "hung"  # the progress watchdog
    NO_ANSWER = "no_answer"  # did not leave a failed step within --drain-timeout-s, or answer a resend
    NOT_JOINED = "did_not_join"  # did not join a new epoch within --epoch-timeout-s
    STEP_ERRORS = "step_errors"  # its computation fails with no request to blame (control/serving/isolation.py)
    NODE_LOST = "node_lost"  # its node's agent went silent for --agent-timeout-s (host lost or cut off)
    EVICTED = "evicted"  # the straggler policy evicts it (slow, not bad): fenced and replaced, not restarted


@dataclass(frozen=True)
class Fault:
    rank_id: int
    cause: FaultCause
    detail: str  # for people: "process killed by SIGKILL"


# First sightings kept per epoch: the watchdog reads only the furthest collective's (`hung_ranks`),
# which is always the newest; the rest is slack. Without a bound an entry per collective a heartbeat
# showed stayed for the whole epoch (a dispatch and a combine per MoE layer: up to 116 a step at
# 58 layers), millions over hours of serving.
SIGHTINGS_KEPT = 64


def superseded_node_beats(batch: Sequence[object]) -> set[int]:
    """Indices of the `NodeHeartbeat`s in one received batch that a later one of the same agent
    (node and session) replaces. An agent's messages arrive in the order it sent them (one
    connection), and each lists every running rank of its node, so its last one in the batch is its
    newest and dates the ranks: all of a batch arrive at one heard time, and an older one, whose
    ages were read earlier, would date a stopped rank (whose age grows) later than it beat, by as
    long as the controller took to read them (heartbeats queued behind an epoch change)."""
    last = {(m.node, m.session): i for i, m in enumerate(batch) if isinstance(m, NodeHeartbeat)}
    return {i for i, m in enumerate(batch) if isinstance(m, NodeHeartbeat) and last[(m.node, m.session)] != i}


class FaultDetector:
    """Detection state of the control thread: pending faults, errors with no culprit, and what the
    watchdog needs (first sighting of each collective, recent step times)."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.faults: dict[int, Fault] = {}
        self.errors: list[str] = []
        self.detected_at: float | None = None
        self.seq_first_seen: dict[int, float] = {}
        self.recent_step_s: deque[float] = deque(maxlen=32)
        self._checked_at = 0.0

    @property
    def pending(self) -> bool:
        return bool(self.faults or self.errors)

    def record(self, fault: Fault) -> bool:
        """Keep `fault` for recovery; False when that rank is already named."""
        if fault.rank_id in self.faults:
            return False
        self.faults[fault.rank_id] = fault
        self._mark_detected()
        return True

    def error(self, detail: str) -> None:
        """A step or epoch failed with no rank to blame (e.g. a peer's collective raised)."""
        self.errors.append(detail)
        self._mark_detected()

    def take(self) -> tuple[dict[int, Fault], list[str], float]:
        """Hand the pending faults and errors to recovery, with when the first was detected."""
        taken = (dict(self.faults), list(self.errors), self.detected_at or time.monotonic())
        self.clear()
        return taken

    def clear(self) -> None:
        self.faults.clear()
        self.errors.clear()
        self.detected_at = None

    def _mark_detected(self) -> None:
        if self.detected_at is None:
            self.detected_at = time.monotonic()

    # ---- signals -------------------------------------------------------------------------

    def node_heartbeat(self, ranks: Mapping[int, RankInfo], msg: NodeHeartbeat, epoch: int, now: float) -> int:
        """The heartbeats of one agent's `NodeHeartbeat` that arrived at `now` (heard clock): each
        of a rank of that node, of the pid it runs. Returns how many were taken."""
        taken = 0
        for beat in msg.beats:
            r = ranks.get(beat.rank_id)
            if r is not None and r.pid == beat.pid and r.node == msg.node:
                self.heartbeat(r, beat.progress, epoch, now - beat.age_s, now)
                taken += 1
        return taken

    def heartbeat(self, rank: RankInfo, progress: Progress, epoch: int, heard_at: float, now: float) -> None:
        """One rank's heartbeat, heard by its agent at `heard_at` and arriving at `now` (heard
        clock). Its agent sends the last one again with a larger age until a newer comes: that
        moves nothing back. What it shows first (a collective entered, a new progress) counts from
        `now`, as when heartbeats came straight here: an age is on the agent's clock, which goes
        on through a stall of this process (the heard clock does not), and a stalled agent's first
        message after it carries what it read before it; dated back by that age, a collective
        entered then would look entered a stall ago, and the watchdog name the ranks behind it."""
        if heard_at > rank.last_heartbeat:
            rank.last_heartbeat = heard_at
        if progress.epoch == epoch and progress.seq not in self.seq_first_seen:
            self.seq_first_seen[progress.seq] = now
            if len(self.seq_first_seen) > SIGHTINGS_KEPT:  # the oldest collective (a late rank's may come last)
                del self.seq_first_seen[min(self.seq_first_seen)]
        if progress != rank.progress:
            rank.progress, rank.progress_at = progress, now

    def new_epoch(self) -> None:
        self.seq_first_seen = {}

    def step_done(self, wall_s: float) -> None:
        self.recent_step_s.append(wall_s)

    def watchdog_deadline_s(self) -> float:
        return adaptive_deadline_s(self.recent_step_s, self.cfg.watchdog_multiple, self.cfg.watchdog_floor_s)

    def result_deadline_s(self) -> float:
        """How long after a step was sent a missing answer is asked for again (health_rules.results_to_ask)."""
        return adaptive_deadline_s(self.recent_step_s, self.cfg.result_timeout_multiple,
                                   self.cfg.result_timeout_floor_s)

    def resend_unanswered(self, rank_id: int, epoch: int, step: int) -> Fault:
        return Fault(rank_id, FaultCause.NO_ANSWER,
                     f"no answer to epoch {epoch} step {step}, nor to a resend within {self.cfg.resend_timeout_s}s "
                     "although it heartbeats (its step link is lost)")

    def check(self, now: float, ranks: Mapping[int, RankInfo], members: Collection[int], in_step: bool,
              epoch: int) -> list[Fault]:
        """Heartbeats of every registered live rank and, while a step runs, the watchdog over the
        members; at most every --health-check-period-s."""
        if not self.cfg.health_checks or now - self._checked_at < self.cfg.health_check_period_s:
            return []
        self._checked_at = now
        watched: dict[int, float] = {}
        loading: set[int] = set()
        for r in ranks.values():  # one pass: at 1,024 ranks this runs 50 times a second
            if r.watched:
                watched[r.rank_id] = r.last_heartbeat
                if r.progress.phase in LOADING_PHASES:
                    loading.add(r.rank_id)
        timeout_s, load_timeout_s = self.cfg.heartbeat_timeout_s, self.cfg.load_heartbeat_timeout_s
        found = [Fault(r, FaultCause.HEARTBEAT_LOST,
                       f"no heartbeat for {max(timeout_s, load_timeout_s):.2f}s while filling its expert slots "
                       "(--load-heartbeat-timeout-s)" if r in loading else
                       f"no heartbeat for {timeout_s:.2f}s (stopped or cut off)")
                 for r in lost_heartbeats(watched, now, timeout_s, loading, load_timeout_s)]
        if in_step:
            deadline = self.watchdog_deadline_s()
            progress: dict[int, Progress] = {}
            heard: dict[int, float] = {}
            for r in members:  # one pass: 50 times a second over every member at 1,024 ranks
                if r not in self.faults:
                    rank = ranks[r]
                    progress[r], heard[r] = rank.progress, rank.last_heartbeat
            for rank_id in hung_ranks(progress, epoch, self.seq_first_seen, now, deadline, heard):
                p = progress[rank_id]
                found.append(Fault(rank_id, FaultCause.HUNG, (
                    f"hung: has not entered collective {max(x.seq for x in progress.values())} the others wait "
                    f"in for {deadline:.2f}s (last at layer {p.layer} {p.phase})")))
        return found

    @staticmethod
    def exited(rank_id: int, returncode: int) -> Fault:
        return Fault(rank_id, FaultCause.EXITED, f"process {exit_reason(returncode)}")

    def no_answer(self, rank_id: int) -> Fault:
        return Fault(rank_id, FaultCause.NO_ANSWER,
                     f"no answer {self.cfg.drain_timeout_s}s after the fault (hung in a collective)")

    def not_joined(self, rank_id: int, epoch: int) -> Fault:
        return Fault(rank_id, FaultCause.NOT_JOINED, f"did not join epoch {epoch} within {self.cfg.epoch_timeout_s}s")
