"""Admission: the backend each request goes to, and the bounded queue of requests that wait
while every ready backend is saturated.

A request is answered at once with `NoBackend` (503) when no backend is ready, and with
`Saturated` (429) when the queue already holds `queue_size` requests or its wait for a backend
with room exceeds `queue_timeout_s`; a saturated router never answers 5xx.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Collection

from elastic_ep.router.backends import Backend, BackendPool
from elastic_ep.router.placement import DEFAULT_LIVE_S, Placements, place_new
from elastic_ep.router.scoring import Limits, choose, rendezvous_order

DEFAULT_STICKY_USERS = 65536
"""Sessions remembered (least recently used forgotten first); a forgotten user is hashed again."""


class NoBackend(Exception):
    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Saturated(Exception):
    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """queue_size: requests that may wait for room; queue_timeout_s: how long one waits;
    retry_after_s: the Retry-After of a 429 or 503; live_s: how long a key this router placed
    counts toward its backend's share before a poll reads it back (router/placement.py)."""

    def __init__(self, pool: BackendPool, limits: Limits, *, queue_size: int = 256, queue_timeout_s: float = 30.0,
                 retry_after_s: int = 1, sticky_users: int = DEFAULT_STICKY_USERS, live_s: float = DEFAULT_LIVE_S):
        self.pool = pool
        self.limits = limits
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.sticky_users = sticky_users
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.waiting = 0
        self._wakeup = asyncio.Event()
        self.placements = Placements(live_s=live_s)
        self._polls_seen = -1

    def notify(self) -> None:
        """Something changed (a request ended, a poll, the set of backends): waiters look again."""
        self._wakeup.set()

    def pick(self, key: bytes, user: str | None = None, exclude: Collection[str] = ()) -> Backend | None:
        """The backend for a request with affinity `key`, or None when all the candidates are
        saturated. Candidates: ready backends not in `exclude` (those that failed this request),
        or every ready one when that leaves none, in the key's rendezvous order with its home
        first (router/placement.py); a user's earlier backend before that."""
        ready = self.pool.ready()
        candidates = [b for b in ready if b.url not in exclude] or ready
        if not candidates:
            return None
        by_url = {b.url: b for b in candidates}
        order = rendezvous_order(key, list(by_url))
        home = self.home(key, order)
        order.remove(home)
        order.insert(0, home)
        sticky = self.sessions.get(user) if user is not None else None
        if sticky in by_url:
            order.remove(sticky)
            order.insert(0, sticky)
        url = choose(order, {u: b.load() for u, b in by_url.items()}, self.limits)
        if url is None:
            return None
        if user is not None:
            self.sessions[user] = url
            self.sessions.move_to_end(user)
            while len(self.sessions) > self.sticky_users:
                self.sessions.popitem(last=False)
        return by_url[url]

    def home(self, key: bytes, order: list[str]) -> str:
        """The home of `key` among `order` (candidates in its rendezvous order): the one the
        backends report, else where this router placed it, else a new placement."""
        if self._polls_seen != self.pool.polls:
            self._polls_seen = self.pool.polls
            self.placements.forget_reported(self.pool.homes)
        for url in (self.pool.homes.get(key), self.placements.get(key)):
            if url in order:
                return url
        url = place_new(order, Counter(self.pool.live) + self.placements.live)
        self.placements.put(key, url)
        return url

    async def acquire(self, key: bytes, user: str | None = None, exclude: Collection[str] = (),
                      resuming: bool = False) -> Backend:
        """A backend with room, its `open_here` counted (give it back with `release`). Waits in
        the queue while every ready backend is saturated; raises NoBackend or Saturated.

        resuming: for a stream already under way (its instance died): it waits, up to
        queue_timeout_s, also for a backend to become ready and whatever the queue holds, since
        refusing it breaks a stream the client has half received."""
        backend = self._take(key, user, exclude, resuming)
        if backend is not None:
            return backend
        if not resuming and self.waiting >= self.queue_size:
            raise Saturated(f"every backend is saturated and {self.waiting} requests wait already; retry later",
                            self.retry_after_s)
        deadline_s = time.monotonic() + self.queue_timeout_s
        self.waiting += 1
        try:
            while True:
                self._wakeup.clear()
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    if not self.pool.ready():
                        raise NoBackend(f"no backend became ready within {self.queue_timeout_s:g}s",
                                        self.retry_after_s)
                    raise Saturated(f"no backend had room within {self.queue_timeout_s:g}s; retry later",
                                    self.retry_after_s)
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining_s)
                except asyncio.TimeoutError:
                    pass
                backend = self._take(key, user, exclude, resuming)
                if backend is not None:
                    return backend
        finally:
            self.waiting -= 1

    def _take(self, key: bytes, user: str | None, exclude: Collection[str], resuming: bool) -> Backend | None:
        if not self.pool.ready() and not resuming:
            reasons = "; ".join(f"{b.url}: {b.reason}" for b in self.pool.backends.values()) or "none configured"
            raise NoBackend(f"no backend is ready ({reasons})", self.retry_after_s)
        backend = self.pick(key, user, exclude)
        if backend is not None:
            backend.open_here += 1
            backend.sent += 1
        return backend

    def release(self, backend: Backend) -> None:
        backend.open_here -= 1
        self.notify()
