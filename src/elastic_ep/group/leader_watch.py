"""Where the group's leader is, for an agent (`elastic-ep agent --etcd URL --ha-group NAME`): a
thread reads the leader key every `interval_s` and keeps the last answer and when etcd last
answered at all. The agent reads both from its own loop without waiting on etcd."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from .store import EtcdUnavailable, GroupStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaderAt:
    """The leader's agent address (its health socket, tcp://HOST:PORT), name and term."""

    controller: str
    name: str
    term: int


class LeaderWatch:
    def __init__(self, store: GroupStore, interval_s: float = 0.1, clock=time.monotonic):
        self.store, self.interval_s, self.clock = store, interval_s, clock
        self.leader: LeaderAt | None = None  # the last leader read whose controller is up
        self.reached_at = float("-inf")  # when etcd last answered (monotonic)
        self.error = ""

    def read_once(self) -> None:
        try:
            found = self.store.leader()
        except EtcdUnavailable as e:
            if not self.error:
                logger.warning("group %s: %s", self.store.group, e)
            self.error = str(e)
            return
        self.error, self.reached_at = "", self.clock()
        if found is not None and found[0].controller:
            seat, term = found
            if self.leader is None or term != self.leader.term:
                logger.info("group %s: the leader is %s (term %d), controller at %s", self.store.group, seat.name,
                            term, seat.controller)
            self.leader = LeaderAt(seat.controller, seat.name, term)

    def group_reached_within(self, seconds: float) -> bool:
        """Whether etcd answered in the last `seconds`: the group is reachable, whatever the leader does."""
        return self.clock() - self.reached_at <= seconds

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.read_once()
            stop.wait(self.interval_s)

    def wait_for_leader(self, timeout_s: float) -> LeaderAt | None:
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            self.read_once()
            if self.leader is not None:
                return self.leader
            time.sleep(0.1)
        return None
