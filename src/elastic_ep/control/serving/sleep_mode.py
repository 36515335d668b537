"""Sleep and wake (vLLM's `POST /sleep?level=`, `POST /wake_up`, `GET /is_sleeping`): the
group keeps its processes, its epoch and its placement, and gives memory back while idle.

Level 1 frees every rank's KV cache (the weights stay in host memory); level 2 also drops the
dense weights and the expert slots, which a wake reads again (the node's host backup the rank
started with, else disk) and checks against their checksums from before. A sleep is refused
(409) while a request runs or waits, a scale or drain is in flight, or before the first epoch.
While asleep no step runs and `/ready` is false with the reason; the HTTP side answers new
requests 503 with Retry-After. A rank that answers with an error is reported in the answer;
after a wake with an error the group stays asleep and a second `wake_up` tries again. A fault
of a rank while the group falls asleep, sleeps or wakes ends the sleep (`abandon`): the sleep
or wake in flight is answered 409, recovery runs as anywhere else, and a sleeping rank wakes
by itself on the next epoch or step it is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import Gauge

from elastic_ep.wire import SleepRank, SleepReply, WakeRank

from ..api import ScaleRejected
from ..cluster import ClusterState
from ..events import EventKind

LEVELS = (1, 2)


class Plane(Protocol):
    def to_worker(self, rank_id: int, message) -> None: ...


@dataclass
class Transition:
    """A sleep (`level` 1 or 2) or a wake (level 0) on its way: the ranks yet to answer."""

    level: int
    waiting: set[int]
    reply: Future
    answers: dict[int, SleepReply] = field(default_factory=dict)


class SleepMode:
    """Built with the cluster state, the control plane, the sleep-state gauge and the callables
    `busy()` (why the group cannot sleep now, "" when it can) and `publish()`."""

    def __init__(self, cluster: ClusterState, plane: Plane, gauge: Gauge, *, busy: Callable[[], str],
                 publish: Callable[[], None]):
        self.cluster = cluster
        self.plane = plane
        self.gauge = gauge
        self.busy = busy
        self.publish = publish
        self.level = 0  # what the group sleeps at: 0 awake
        self.moving: Transition | None = None
        self.last: dict[int, dict[str, Any]] = {}  # rank -> its last answer, for /cluster

    @property
    def blocks_steps(self) -> bool:
        """No step may run: asleep, or on the way in or out."""
        return self.level > 0 or self.moving is not None

    def sleep(self, level: int, reply: Future) -> None:
        """Start a sleep at `level`; `reply` gets the view once every member answered, or a
        ScaleRejected (400 a level other than 1 or 2, 409 when busy or already asleep)."""
        if level not in LEVELS:
            raise ScaleRejected(f"level {level} is not a sleep level; use 1 (free the KV cache) or 2 "
                                "(drop the weights too)", 400, "level")
        if self.moving is not None:
            raise ScaleRejected("a sleep or wake is in flight; retry when GET /is_sleeping has settled", 409, "level")
        if self.level:
            raise ScaleRejected(f"already asleep at level {self.level}; POST /wake_up first", 409, "level")
        why = self.busy()
        if why:
            raise ScaleRejected(f"cannot sleep now: {why}", 409, "level")
        self._send(Transition(level, set(self.cluster.members), reply), SleepRank(level))

    def wake(self, reply: Future) -> None:
        """Start a wake; `reply` gets the view once every member answered. Awake already: answered
        at once."""
        if self.moving is not None:
            raise ScaleRejected("a sleep or wake is in flight; retry when GET /is_sleeping has settled", 409, "level")
        if not self.level:
            reply.set_result(self.view())
            return
        self._send(Transition(0, set(self.cluster.members), reply), WakeRank())

    def abandon(self, why: str) -> None:
        """A fault: the group is awake from here on (its ranks wake on their next epoch or step);
        a sleep or wake in flight is answered 409 with `why`."""
        t, self.moving, self.level = self.moving, None, 0
        self.gauge.set(0)
        self.cluster.events.add(EventKind.SLEEP, f"sleep ended by a fault: {why}")
        if t is not None:
            t.reply.set_exception(ScaleRejected(f"{why}; the group recovers awake", 409, "level"))

    def on_reply(self, msg: SleepReply) -> None:
        t = self.moving
        self.last[msg.rank_id] = {"level": msg.level, "rss_before_bytes": msg.rss_before_bytes,
                                  "rss_after_bytes": msg.rss_after_bytes, "seconds": msg.seconds, "error": msg.error}
        if t is None or msg.rank_id not in t.waiting:
            return
        t.waiting.discard(msg.rank_id)
        t.answers[msg.rank_id] = msg
        if t.waiting:
            return
        self.moving = None
        errors = {r: a.error for r, a in t.answers.items() if a.error}
        c = self.cluster
        if t.level:
            self.level = t.level
            c.set_readiness(False, f"asleep at level {t.level}: POST /wake_up")
        elif not errors:
            self.level = 0
            c.set_readiness(True)
        before = sum(a.rss_before_bytes for a in t.answers.values())
        after = sum(a.rss_after_bytes for a in t.answers.values())
        what = f"asleep at level {t.level}" if t.level else ("awake" if not errors else "still asleep")
        c.events.add(EventKind.SLEEP, f"{what}: resident memory of ranks {sorted(t.answers)} {before} -> {after} bytes"
                     + (f"; errors {errors}" if errors else ""), rss_before_bytes=before, rss_after_bytes=after)
        self.gauge.set(self.level)
        self.publish()
        t.reply.set_result(self.view())

    def view(self) -> dict[str, Any]:
        """JSON of GET /is_sleeping and /cluster's "sleep"."""
        return {"is_sleeping": self.level > 0, "level": self.level,
                "moving_to": None if self.moving is None else self.moving.level,
                "ranks": {str(r): v for r, v in sorted(self.last.items())}}

    def _send(self, t: Transition, message) -> None:
        self.moving = t
        for r in sorted(t.waiting):
            self.plane.to_worker(r, message)
        self.publish()
