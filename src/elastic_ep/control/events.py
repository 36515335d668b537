"""The cluster's event log: every fault, fence, epoch, recovery, rejoin, scale step and chaos action,
numbered so a reader can ask for what came after the last one it saw.

Written by the control thread only; readers get copies through the published snapshot. Every
event is also one log line on the `elastic_ep.events` logger (stderr, as `--log-format` says):
warnings for what went wrong or was injected, errors for a stopped control loop, info for the
rest; the JSON format carries the event's fields.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from enum import Enum
from typing import Any


class EventKind(str, Enum):
    STARTED = "started"  # the agent started a rank's process
    START_FAILED = "start-failed"  # the agent could not start a rank's process (the OS refused: why in the message)
    REGISTERED = "registered"  # the rank loaded its weights, warmed up and registered
    ADOPTED = "adopted"  # a new leader of the controller group took over a rank as it runs
    FAULT = "fault"  # a rank was named by a detection signal (cause in the message)
    FENCING = "fencing"  # culprits are being killed and the others leave the failed step
    FENCE_TIMEOUT = "fence-timeout"  # an agent did not confirm a kill
    EPOCH = "epoch"  # a new epoch formed and was verified (placement, transfers, timings)
    EPOCH_FAILED = "epoch-failed"  # an epoch did not form
    VERIFY_FAILED = "verify-failed"  # slots hold weights other than their expert's
    RECOVERED = "recovered"  # the first step after a fault completed (the recovery record)
    REBALANCED = "rebalanced"  # the background rebalance reached its target (moves, time, balance)
    DEGRADED = "degraded"  # too few ranks (or no placement): not ready
    REQUEST_ERROR = "request-error"  # requests ended with an error
    BACKUP = "backup"  # a node's host-memory backup was written (or is off)
    BACKUP_LOST = "backup-lost"  # a node's backup can no longer be used
    REPLACE = "replace"  # a down rank moves to a replacement node
    AGENT = "agent"  # a node's agent registered (or registered again)
    NODE_LOST = "node-lost"  # a node's agent went silent: its ranks are faults
    RETIRED = "retired"  # a rank left the cluster
    REFUSED = "refused"  # a rank registered on another device kind than the group's: stopped for good
    SCALE = "scale"  # a scale started or finished
    SCALE_FAILED = "scale-failed"
    DRAINED = "drained"  # leaving ranks drained on scale-down
    CHAOS = "chaos"  # a fault injected on request
    STRAGGLER = "straggler"  # the straggler policy decided (derate, restore, evict, hold) with its evidence
    STANDBY = "standby"  # a standby rank started, stood by, was taken or lost
    HARDWARE = "hardware"  # a node reported an Xid critical error
    STALLED = "stalled"  # no step progressed for the stall deadline: not ready (reason in the message)
    STALL_ENDED = "stall-ended"  # no step in flight past the stall deadline, no member silent
    SLEEP = "sleep"  # the group fell asleep or woke (memory given back per rank)
    WARMUP = "warmup"  # the readiness gate's warm-up ran (shapes, slots that computed per rank)
    ROLLOUT = "rollout"  # a rolling restart started, replaced a rank, or ended
    RESEND = "resend"  # a step's answer missing past the result deadline was asked for again (ResendResult)
    FATAL = "fatal"  # the control loop stopped


WARNING_KINDS = frozenset({
    EventKind.FAULT, EventKind.FENCING, EventKind.FENCE_TIMEOUT, EventKind.EPOCH_FAILED, EventKind.VERIFY_FAILED,
    EventKind.DEGRADED, EventKind.REQUEST_ERROR, EventKind.BACKUP_LOST, EventKind.SCALE_FAILED, EventKind.CHAOS,
    EventKind.STALLED, EventKind.STRAGGLER, EventKind.HARDWARE, EventKind.REFUSED, EventKind.RESEND,
    EventKind.START_FAILED,
})
logger = logging.getLogger("elastic_ep.events")


def log_level(kind: EventKind) -> int:
    if kind == EventKind.FATAL:
        return logging.ERROR
    return logging.WARNING if kind in WARNING_KINDS else logging.INFO


class EventLog:
    """The last `capacity` events, each a JSON-ready dict
    {"id", "time_s" (unix), "kind", "rank_id", "message", **details}; ids count from 1."""

    def __init__(self, capacity: int = 1000):
        self._events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._ids = itertools.count(1)

    def add(self, kind: EventKind, message: str, rank_id: int | None = None, **details) -> dict[str, Any]:
        event = {"id": next(self._ids), "time_s": time.time(), "kind": kind.value, "rank_id": rank_id,
                 "message": message, **details}
        self._events.append(event)
        rank = f" rank={rank_id}" if rank_id is not None else ""
        logger.log(log_level(kind), "event %s%s: %s", kind.value, rank, message, extra={"fields": event})
        return event

    def all(self) -> list[dict[str, Any]]:
        return list(self._events)


def select_events(events: list[dict[str, Any]], since: int | None, limit: int | None) -> list[dict[str, Any]]:
    """Events with id > `since` (all kept ones when None), the last `limit` of them (all when None)."""
    if since is not None:
        events = [e for e in events if e["id"] > since]
    return events[-limit:] if limit else events
