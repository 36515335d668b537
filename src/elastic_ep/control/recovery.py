"""Recovery: from pending faults to a new epoch over the live ranks, or to a degraded cluster.

When a rank dies or hangs: fence it (its agent SIGKILLs it and confirms; a hung process must
not come back into an old epoch), wait until every other member has left the failed step (one
that does not answer within --drain-timeout-s is named too), move the culprits' requests back
to the queue (re-prefilled elsewhere: prompt plus tokens so far), schedule their restart, and
form a new epoch over the live ranks; the step loop then re-runs the interrupted step. If the
live ranks cannot hold every expert the cluster degrades: not ready, with the reason, until
ranks return; streams wait up to --degraded-timeout-s. A slow rank never gets here.

A step that fails with every rank alive is retried in a re-formed group; after
`MAX_FAILURES_WITHOUT_CULPRIT` such failures in a row the step's requests end with the error.

The `RecoveryRecord` follows one recovery from the first detection to the first step that
completes afterwards; a second fault before then extends it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_ep.wire import AbortEpoch

from .detector import Fault, FaultCause
from .epoch_change import EpochReport
from .events import EventKind
from .ranks import RankStatus
from .scheduler import StepBatch

if TYPE_CHECKING:
    from .controller import Controller

MAX_FAILURES_WITHOUT_CULPRIT = 3


@dataclass
class RecoveryRecord:
    """detected_at: monotonic time of the first detection; detect_to_fence_s: the last fence and
    drain; epoch: the last epoch formed by this recovery."""

    detected_at: float
    culprits: list[int]
    cause: str
    detect_to_fence_s: float
    epoch: EpochReport | None = None

    def then(self, later: RecoveryRecord) -> RecoveryRecord:
        """This record extended by a fault that came before it was complete."""
        return RecoveryRecord(min(self.detected_at, later.detected_at), sorted(set(self.culprits) | set(later.culprits)),
                              f"{self.cause}; then {later.cause}", later.detect_to_fence_s, self.epoch)

    def event_fields(self, recompute_s: float, total_s: float) -> dict[str, Any]:
        epoch = self.epoch.fields() if self.epoch is not None else {}
        return {"culprits": self.culprits, "cause": self.cause, "detect_to_fence_s": round(self.detect_to_fence_s, 4),
                **epoch, "recompute_s": round(recompute_s, 4), "total_s": round(total_s, 4)}


def describe(faults: dict[int, Fault], errors: list[str]) -> str:
    return "; ".join(f"rank {r}: {f.detail}" for r, f in sorted(faults.items())) or (
        "error without a dead rank: " + "; ".join(errors[:4]))


class Recovery:
    def __init__(self, ctl: Controller):
        self.ctl = ctl
        self.cluster = ctl.cluster
        self.record: RecoveryRecord | None = None
        self.failures_without_culprit = 0

    def run(self) -> None:
        """Fence, drain, then a new epoch over the live ranks (or degrade)."""
        ctl, c = self.ctl, self.cluster
        t0 = time.monotonic()
        ctl.rebalancer.cancel()
        self.fence_and_drain()
        fence_s = time.monotonic() - t0
        culprits, errors, detected_at = ctl.detector.take()
        ctl.isolation.reset()
        if ctl.traces is not None:
            ctl.traces.recovery_began(detected_at, describe(culprits, errors), culprits,
                                      any(f.cause == FaultCause.EVICTED for f in culprits.values()))
        live = [r for r in c.members if r not in culprits and not c.ranks[r].status.down]
        for r in culprits:
            moved = ctl.scheduler.evict_rank(r)
            if ctl.traces is not None:
                for seq in moved:
                    ctl.traces.moved(seq.seq_id, "fault", r, None, time.time_ns())
            if culprits[r].cause == FaultCause.EVICTED:
                ctl.metrics.ranks.evicted(r, time.monotonic())
            else:
                ctl.metrics.forget_rank(r)
            c.delay_s.pop(r, None)
            c.broken.pop(r, None)
            if ctl.scaling.joiner(r):
                ctl.scaling.fail(f"joining rank {r} failed: {culprits[r].detail}")
            if ctl.scaling.leaves(r):
                ctl.nodes.forget_rank(r, f"rank {r} left with its scale")
            elif culprits[r].cause == FaultCause.EVICTED:  # its card is suspect: replaced, never restarted there
                ctl.nodes.forget_rank(r, f"rank {r} evicted: {culprits[r].detail}")
            else:
                ctl.nodes.schedule_restart(r)
        for r in [r for r in live if ctl.scaling.leaves(r) and c.ranks[r].status != RankStatus.DRAINING]:
            live.remove(r)
            ctl.nodes.stop_rank(r)
        cause = describe(culprits, errors)
        for label in {f.cause.value for f in culprits.values()} or {"collective"}:
            ctl.metrics.recoveries.labels(label).inc()
        if not culprits:
            self.failures_without_culprit += 1
            failed = ctl.steps.failed_batch
            if self.failures_without_culprit >= MAX_FAILURES_WITHOUT_CULPRIT and failed is not None:
                self._fail_batch(failed, cause)
        record = RecoveryRecord(detected_at, sorted(culprits), cause, fence_s)
        self.record = self.record.then(record) if self.record is not None else record
        c.events.add(EventKind.FENCING, f"fenced {sorted(culprits)}: {cause}", min(culprits) if culprits else None)
        live = sorted(set(live) | set(ctl.joiners(live)))
        holding = [r for r in live if not ctl.scaling.leaves(r)]
        if not c.can_serve(holding):
            self.degrade(holding)
            return
        ctl.rebalancer.request("recovery")  # first: no snapshot may show the new epoch settled
        if ctl.form_epoch(live, "recovery", holding=holding, restore=True) is None:
            ctl.rebalancer.cancel()

    def fence_and_drain(self) -> None:
        """Fence every culprit and wait until every other member has left the failed step; a
        member that does not answer within --drain-timeout-s becomes a culprit too, and a fence
        not confirmed within --fence-timeout-s counts the rank as dead."""
        ctl, c, cfg = self.ctl, self.cluster, self.ctl.cfg
        faults = ctl.detector.faults
        steps = ctl.steps
        # the failed epoch is over: members waiting on a peer that will never answer (hung, cut
        # off) give up their collectives now instead of at the collective timeout
        for rank_id in c.members:
            ctl.plane.to_heartbeat(rank_id, AbortEpoch(c.epoch))
        deadline = time.monotonic() + cfg.drain_timeout_s
        while True:
            for rank_id in list(faults):
                r = c.ranks[rank_id]
                if not r.status.down and r.status != RankStatus.FENCING and r.pid is not None:
                    ctl.nodes.fence(rank_id, faults[rank_id].detail)
            waiting = [r for r in steps.in_step if r not in steps.replies and r not in faults]
            fencing = [r.rank_id for r in c.ranks.values() if r.status == RankStatus.FENCING]
            if not waiting and not fencing:
                steps.in_step = set()
                return
            if time.monotonic() > deadline:
                for r in waiting:
                    ctl.fault(ctl.detector.no_answer(r))
                for r in fencing:
                    c.events.add(EventKind.FENCE_TIMEOUT, f"agent did not confirm fencing rank {r}", r)
                    c.ranks[r].status = RankStatus.DEAD
                deadline = time.monotonic() + cfg.fence_timeout_s
            ctl.pump(0.002)

    def degrade(self, live: list[int], reason: str = "") -> None:
        """Not ready until enough ranks return; `live` stay members."""
        c = self.cluster
        reason = reason or (f"too few ranks: {len(live)} live ranks x {c.slots_per_rank} slots cannot hold "
                            f"{c.num_experts} experts (need {c.min_ranks} ranks); waiting for ranks to return")
        c.set_readiness(False, reason)
        c.members = [r for r in c.members if r in live]
        c.degraded_since = c.degraded_since or time.monotonic()
        c.events.add(EventKind.DEGRADED, reason)
        self.ctl.publish()

    def end_requests_if_degraded_too_long(self) -> None:
        """Requests already streaming wait while the cluster cannot serve, but not forever:
        after --degraded-timeout-s they end with an error that says why."""
        c, cfg = self.cluster, self.ctl.cfg
        if c.degraded_since is None or time.monotonic() - c.degraded_since < cfg.degraded_timeout_s:
            return
        error = f"not served for {cfg.degraded_timeout_s:.0f}s: {c.readiness.reason}"
        for seq_id in list(self.ctl.scheduler.by_id):
            self.ctl.streams.end_with_error(seq_id, error)
        c.events.add(EventKind.REQUEST_ERROR, f"ended the waiting requests: {error}")
        c.degraded_since = time.monotonic()

    def _fail_batch(self, batch: StepBatch, error: str) -> None:
        """End the requests of a step that keeps failing with no rank to blame (a deterministic
        error, not a fault): they finish with an error, the server goes on serving."""
        for chunks in batch.chunks.values():
            for chunk in chunks:
                self.ctl.streams.end_with_error(chunk.seq_id, error)
        self.cluster.events.add(EventKind.REQUEST_ERROR, f"failed the requests of a step that failed "
                                f"{self.failures_without_culprit} times: {error}")
        self.failures_without_culprit = 0
        self.ctl.steps.failed_batch = None

    def epoch_formed(self, report: EpochReport) -> None:
        if self.record is not None:
            self.record.epoch = report

    def step_completed(self, wall_s: float) -> None:
        """The first step after a recovery closes its record with the `recovered` event."""
        self.failures_without_culprit = 0
        record, self.record = self.record, None
        if record is None:
            return
        total_s = time.monotonic() - record.detected_at
        self.ctl.metrics.recovery_seconds.observe(round(total_s, 4))
        if self.ctl.traces is not None:
            self.ctl.traces.recovery_ended(self.cluster.epoch)
        self.cluster.events.add(EventKind.RECOVERED, f"epoch {self.cluster.epoch} serving again after {total_s:.3f}s",
                                **record.event_fields(wall_s, total_s))
