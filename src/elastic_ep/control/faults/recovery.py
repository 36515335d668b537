"""Recovery: from pending faults to a new epoch over the live ranks, or to a degraded cluster.

A fault runs one way: the detector names it, `Recovery.run` takes it, fences the culprits and
drains the failed step, asks the epoch change for `Recover(live, holding)` and handles the
outcome itself (formed: the record notes the epoch; no placement: degrade). An epoch that does
not form leaves its faults with the detector again and raises `RecoveryNeeded`, so the next
`run` starts over with them.

When a rank dies or hangs: fence it (its agent SIGKILLs it and confirms; a hung process must
not come back into an old epoch), wait until every other member has left the failed step (one
that does not answer within --drain-timeout-s is named too), move the culprits' requests back
to the queue (re-prefilled elsewhere: prompt plus tokens so far), schedule their restart, and
form a new epoch over the live ranks; the step loop's next step recomputes the interrupted one.
If the live ranks cannot hold every expert the cluster degrades: not ready, with the reason,
until ranks return; streams wait up to --degraded-timeout-s. A slow rank never gets here.

The `RecoveryRecord` follows one recovery from the first detection to the first step that
completes afterwards; a second fault before then extends it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..cluster import ClusterState
from ..config import ServeConfig
from ..epochs.epoch_change import EpochReport, NoPlacement
from ..epochs.requests import EpochRequest, Recover
from ..events import EventKind
from ..metrics import ClusterMetrics
from ..ranks import RankStatus
from ..tracing import RequestTraces
from .detector import Fault, FaultCause, FaultDetector


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
        return RecoveryRecord(min(self.detected_at, later.detected_at),
                              sorted(set(self.culprits) | set(later.culprits)),
                              f"{self.cause}; then {later.cause}", later.detect_to_fence_s, self.epoch)

    def event_fields(self, recompute_s: float, total_s: float) -> dict[str, Any]:
        epoch = self.epoch.fields() if self.epoch is not None else {}
        return {"culprits": self.culprits, "cause": self.cause, "detect_to_fence_s": round(self.detect_to_fence_s, 4),
                **epoch, "recompute_s": round(recompute_s, 4), "total_s": round(total_s, 4)}


def describe(faults: dict[int, Fault], errors: list[str]) -> str:
    return "; ".join(f"rank {r}: {f.detail}" for r, f in sorted(faults.items())) or (
        "error without a dead rank: " + "; ".join(errors[:4]))


class InFlight(Protocol):
    """The step loop, as recovery sees the step a fault interrupted."""

    def unanswered(self, excluded: dict[int, Fault]) -> list[int]: ...
    def abandon(self) -> None: ...
    def after_fault(self, culprit_found: bool, error: str) -> None: ...


class Requests(Protocol):
    """The scheduler: the sequences in flight (`by_id`), and a lost rank's sequences requeued."""

    by_id: Mapping[int, object]

    def evict_rank(self, rank_id: int) -> list: ...  # the sequences it moved


class Streams(Protocol):
    def end_with_error(self, seq_id: int, error: str) -> None: ...


class Scale(Protocol):
    """The scale in flight (membership/scale_driver.py)."""

    def joiner(self, rank_id: int) -> bool: ...
    def leaves(self, rank_id: int) -> bool: ...
    def fail(self, error: str) -> None: ...


class Processes(Protocol):
    """The rank processes (membership/nodes.py)."""

    def fence(self, rank_id: int, reason: str) -> None: ...
    def confirm_lost(self, rank_id: int) -> None: ...
    def forget_rank(self, rank_id: int, message: str) -> None: ...
    def schedule_restart(self, rank_id: int) -> None: ...
    def stop_rank(self, rank_id: int) -> None: ...
    def abort_epoch(self, rank_ids: Iterable[int], epoch: int) -> None: ...


class Rebalance(Protocol):
    def request(self, reason: str) -> None: ...
    def cancel(self) -> None: ...


class Recovery:
    """Built with what it uses: the cluster state it reads, the detector it takes faults from,
    the step in flight, the requests and their streams, the scale, the rank processes, the
    rebalance, and the callables `pump(timeout_s)`, `fault(Fault)`, `joiners(live)`,
    `form(EpochRequest, reason)` (the loop's epoch change: a report, `NoPlacement`, or
    RecoveryNeeded raised), `leave(live)` (members that drop out when degrading),
    `reset_isolation()` and `publish()`; `traces`, the request traces when tracing is on."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, detector: FaultDetector, metrics: ClusterMetrics,
                 steps: InFlight, requests: Requests, streams: Streams, scale: Scale, processes: Processes,
                 rebalance: Rebalance, *,
                 pump: Callable[[float], None], fault: Callable[[Fault], None],
                 joiners: Callable[[list[int]], list[int]],
                 form: Callable[[EpochRequest, str], EpochReport | NoPlacement],
                 leave: Callable[[list[int]], None], reset_isolation: Callable[[], None],
                 publish: Callable[[], None], traces: RequestTraces | None = None):
        self.cluster = cluster
        self.cfg = cfg
        self.detector = detector
        self.metrics = metrics
        self.steps = steps
        self.requests = requests
        self.streams = streams
        self.scale = scale
        self.processes = processes
        self.rebalance = rebalance
        self.pump = pump
        self.fault = fault
        self.joiners = joiners
        self.form = form
        self.leave = leave
        self.reset_isolation = reset_isolation
        self.publish = publish
        self.traces = traces
        self.record: RecoveryRecord | None = None
        for cause in [c.value for c in FaultCause] + ["collective"]:  # a zero sample before the first recovery
            metrics.recoveries.labels(cause)

    @property
    def open(self) -> bool:
        """A recovery has not yet seen its first completed step."""
        return self.record is not None

    def run(self) -> None:
        """Fence, drain, then a new epoch over the live ranks (or degrade). Raises RecoveryNeeded
        when the epoch did not form (its faults are pending again)."""
        c = self.cluster
        t0 = time.monotonic()
        self.rebalance.cancel()
        self.fence_and_drain()
        fence_s = time.monotonic() - t0
        culprits, errors, detected_at = self.detector.take()
        self.reset_isolation()
        if self.traces is not None:
            self.traces.recovery_began(detected_at, describe(culprits, errors), culprits,
                                       any(f.cause == FaultCause.EVICTED for f in culprits.values()))
        live = [r for r in c.members if r not in culprits and not c.ranks[r].status.down]
        for r in culprits:
            moved = self.requests.evict_rank(r)
            if self.traces is not None:
                for seq in moved:
                    self.traces.moved(seq.seq_id, "fault", r, None, time.time_ns())
            if culprits[r].cause == FaultCause.EVICTED:
                self.metrics.ranks.evicted(r, time.monotonic())
            else:
                self.metrics.forget_rank(r)
            if self.scale.joiner(r):
                self.scale.fail(f"joining rank {r} failed: {culprits[r].detail}")
            if self.scale.leaves(r):
                self.processes.forget_rank(r, f"rank {r} left with its scale")
            elif culprits[r].cause == FaultCause.EVICTED:  # its card is suspect: replaced, never restarted there
                self.processes.forget_rank(r, f"rank {r} evicted: {culprits[r].detail}")
            else:
                self.processes.schedule_restart(r)
        for r in [r for r in live if self.scale.leaves(r) and c.ranks[r].status != RankStatus.DRAINING]:
            live.remove(r)
            self.processes.stop_rank(r)
        cause = describe(culprits, errors)
        for label in {f.cause.value for f in culprits.values()} or {"collective"}:
            self.metrics.recoveries.labels(label).inc()
        self.steps.after_fault(bool(culprits), cause)
        record = RecoveryRecord(detected_at, sorted(culprits), cause, fence_s)
        self.record = self.record.then(record) if self.record is not None else record
        c.events.add(EventKind.FENCING, f"fenced {sorted(culprits)}: {cause}", min(culprits) if culprits else None)
        live = sorted(set(live) | set(self.joiners(live)))
        holding = [r for r in live if not self.scale.leaves(r)]
        if not c.can_serve(holding):
            self.degrade(holding)
            return
        self.rebalance.request("recovery")  # first: no snapshot may show the new epoch settled
        outcome = self.form(Recover(live, holding), "recovery")
        if isinstance(outcome, NoPlacement):
            self.rebalance.cancel()
            self.degrade(live, outcome.reason)
        else:
            self.note_epoch(outcome)

    def fence_and_drain(self) -> None:
        """Fence every culprit and wait until every other member has left the failed step; a
        member that does not answer within --drain-timeout-s becomes a culprit too, and a fence
        not confirmed within --fence-timeout-s counts the rank as dead."""
        c, cfg = self.cluster, self.cfg
        faults = self.detector.faults
        # the failed epoch is over: members waiting on a peer that will never answer (hung, cut
        # off) give up their collectives now instead of at the collective timeout
        self.processes.abort_epoch(c.members, c.epoch)
        deadline = time.monotonic() + cfg.drain_timeout_s
        while True:
            for rank_id in list(faults):
                r = c.ranks[rank_id]
                if not r.status.down and r.status != RankStatus.FENCING and r.pid is not None:
                    self.processes.fence(rank_id, faults[rank_id].detail)
            waiting = self.steps.unanswered(faults)
            fencing = [r.rank_id for r in c.ranks.values() if r.status == RankStatus.FENCING]
            if not waiting and not fencing:
                self.steps.abandon()
                return
            if time.monotonic() > deadline:
                for r in waiting:
                    self.fault(self.detector.no_answer(r))
                for r in fencing:
                    c.events.add(EventKind.FENCE_TIMEOUT, f"agent did not confirm fencing rank {r}", r)
                    self.processes.confirm_lost(r)
                deadline = time.monotonic() + cfg.fence_timeout_s
            self.pump(0.002)

    def degrade(self, live: Iterable[int], reason: str = "") -> None:
        """Not ready until enough ranks return; `live` stay members."""
        c, live = self.cluster, list(live)
        reason = reason or (f"too few ranks: {len(live)} live ranks x {c.slots_per_rank} slots cannot hold "
                            f"{c.num_experts} experts (need {c.min_ranks} ranks); waiting for ranks to return")
        c.set_readiness(False, reason)
        self.leave(live)
        c.degraded_since = c.degraded_since or time.monotonic()
        c.events.add(EventKind.DEGRADED, reason)
        self.publish()

    def end_requests_if_degraded_too_long(self) -> None:
        """Requests already streaming wait while the cluster cannot serve, but not forever:
        after --degraded-timeout-s they end with an error that says why."""
        c, cfg = self.cluster, self.cfg
        if c.degraded_since is None or time.monotonic() - c.degraded_since < cfg.degraded_timeout_s:
            return
        error = f"not served for {cfg.degraded_timeout_s:.0f}s: {c.readiness.reason}"
        for seq_id in list(self.requests.by_id):
            self.streams.end_with_error(seq_id, error)
        c.events.add(EventKind.REQUEST_ERROR, f"ended the waiting requests: {error}")
        c.degraded_since = time.monotonic()

    def note_epoch(self, report: EpochReport) -> None:
        """An epoch that serves again after this recovery (its own, or the rejoin that ends a
        degraded wait): the `recovered` event reports it."""
        if self.record is not None:
            self.record.epoch = report

    def step_completed(self, wall_s: float) -> None:
        """The first step after a recovery closes its record with the `recovered` event."""
        record, self.record = self.record, None
        if record is None:
            return
        total_s = time.monotonic() - record.detected_at
        self.metrics.recovery_seconds.observe(round(total_s, 4))
        if self.traces is not None:
            self.traces.recovery_ended(self.cluster.epoch)
        self.cluster.events.add(EventKind.RECOVERED, f"epoch {self.cluster.epoch} serving again after {total_s:.3f}s",
                                **record.event_fields(wall_s, total_s))
