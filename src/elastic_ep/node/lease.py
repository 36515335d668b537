"""The agent's lease on the controller: how a node that is cut off stops by itself.

A node the controller cannot reach cannot be fenced from outside, so it fences itself: its
agent holds a lease that every answer of the controller renews (`LeaseRenew` to its
`AgentAlive`); when `lease_s` passes without one, or the controller says it gave up on this
session (`SessionEnded`), the agent kills its workers and registers again, in recover mode,
under a new session, until a welcome comes back. The survivors never wait for this: the
controller drops an agent it has not heard for --agent-timeout-s, and the new epoch leaves its
ranks out. Pure state, driven by the agent with its monotonic clock.

An agent whose ranks beat sends the controller a `NodeHeartbeat` every heartbeat interval, and
the controller takes that as word from the agent too; its `AgentAlive` (the lease's renewal, its
reports) then goes every `ALIVE_WITH_BEATS_S` at most (a quarter of the lease at least), not every
`alive_interval_s`: at 1,024 ranks (128 agents) the alives and their renewals were 2,560 of the
~4,400 frames a second the control thread handled.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from elastic_ep.wire import AGENT_HELLO_INTERVAL_S

ALIVE_WITH_BEATS_S = 0.5  # the AgentAlive's period while the agent's NodeHeartbeats say it is alive


def new_session() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class Lease:
    """lease_s: how long the agent's ranks may run without word from the controller;
    alive_interval_s: how often it says it is alive; hello_interval_s: how often it asks to be
    welcomed while it is not."""

    lease_s: float
    alive_interval_s: float = 0.1
    hello_interval_s: float = AGENT_HELLO_INTERVAL_S
    session: str = field(default_factory=new_session)
    welcomed: bool = False
    renewed_at: float = 0.0
    _hello_at: float = float("-inf")
    _alive_at: float = float("-inf")
    _node_beat_at: float = float("-inf")  # the agent's last `NodeHeartbeat` sent

    def welcome(self, session: str, now: float) -> bool:
        """The controller welcomed `session`; False for another (older) session's welcome."""
        if session != self.session:
            return False
        self.welcomed, self.renewed_at = True, now
        return True

    def renew(self, session: str, now: float) -> None:
        if self.welcomed and session == self.session:
            self.renewed_at = now

    def expired(self, now: float) -> bool:
        """A welcomed session whose lease ran out: time to fence this node's ranks."""
        return self.welcomed and now - self.renewed_at > self.lease_s

    def restart(self) -> None:
        """A new session: unwelcomed until the controller answers its hello."""
        self.session, self.welcomed = new_session(), False
        self._hello_at = float("-inf")

    def hello_due(self, now: float) -> bool:
        if self.welcomed or now - self._hello_at < self.hello_interval_s:
            return False
        self._hello_at = now
        return True

    def node_beat_sent(self, now: float) -> None:
        self._node_beat_at = now

    def alive_due(self, now: float, beat_interval_s: float = 0.0) -> bool:
        """An `AgentAlive` is due: every alive_interval_s, or, while the agent's `NodeHeartbeat`s go
        (one within the last two of their `beat_interval_s`), every ALIVE_WITH_BEATS_S, at most a
        quarter of the lease."""
        beating = beat_interval_s > 0 and now - self._node_beat_at <= 2 * beat_interval_s
        interval_s = max(self.alive_interval_s, min(ALIVE_WITH_BEATS_S, self.lease_s / 4)) if beating \
            else self.alive_interval_s
        if not self.welcomed or now - self._alive_at < interval_s:
            return False
        self._alive_at = now
        return True
