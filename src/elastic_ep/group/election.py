"""Leader election of the controller group through one etcd lease.

Each controller holds a lease of `ttl_s` seconds, renewed every quarter of it, and keeps its `Seat`
under `members/<name>` with it. Every `tick_s` a standby campaigns (the leader with each keepalive):
one transaction puts its seat at the leader key under its lease if nobody holds the key, and reads
the key either way. The controller
whose lease holds the key leads; its **term** is the key's create revision, which etcd never
hands out twice and only ever raises, so a later leader always has the higher term.

Safety: the leader counts its leadership valid until `ttl_s - margin_s` after it *sent* the last
keepalive that succeeded (etcd cannot expire the lease before then), and a watchdog thread deposes
it the moment that passes without a newer success, whatever a blocked call to etcd is doing. It is
deposed too when the key is held under another lease or its lease expired. A deposed leader never
leads again in this process (`on_deposed`: serve exits). So two controllers never both believe they
lead at the same time by etcd's clock; frames an old leader still has in flight carry its lower
term and are dropped by agents and workers (wire/codec.py `TermFence`)."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec

from .store import EtcdUnavailable, GroupStore, Seat

logger = logging.getLogger(__name__)


class Role(str, enum.Enum):
    STANDBY = "standby"
    LEADER = "leader"
    DEPOSED = "deposed"


@dataclass(frozen=True)
class ElectionState:
    """role: this controller's; term: its term while it leads, else the leader's (0: none known);
    leader: the leader's seat (None: none known); etcd_error: the last failure to reach etcd ("":
    the last call succeeded); deposed_reason: why it stopped leading."""

    role: Role = Role.STANDBY
    term: int = 0
    leader: Seat | None = None
    etcd_error: str = ""
    deposed_reason: str = ""
    seats: tuple[Seat, ...] = ()  # every controller of the group with a live lease, as last read
    valid_until: float = float("-inf")  # while leading: when its leadership lapses (the clock's time)


class Election:
    """Campaign for `store`'s group as `seat` until `stop`; `on_elected(term)` and
    `on_deposed(reason)` are called once each at most, from the election's threads."""

    def __init__(self, store: GroupStore, seat: Seat, ttl_s: int = 2, tick_s: float = 0.1, margin_s: float = 0.25,
                 on_elected: Callable[[int], None] = lambda term: None,
                 on_deposed: Callable[[str], None] = lambda reason: None, clock: Callable[[], float] = time.monotonic):
        if ttl_s < 2:
            raise ValueError(f"--ha-lease-s {ttl_s}: etcd leases are whole seconds, at least 2")
        self.store, self.ttl_s, self.tick_s, self.margin_s = store, ttl_s, tick_s, margin_s
        self.on_elected, self.on_deposed, self.clock = on_elected, on_deposed, clock
        self._seat = seat
        self._lock = threading.Lock()
        self._state = ElectionState()
        self._lease = 0
        self._renewed_sent = float("-inf")  # when the last successful keepalive (or grant) was sent
        self._valid_until = float("-inf")  # leadership holds until then
        self._put_seat: Seat | None = None  # the member seat last written under this lease
        self._leader_revision = 0

    @property
    def state(self) -> ElectionState:
        with self._lock:
            return self._state

    def set_seat(self, **changes) -> None:
        """Change this controller's seat (its controller address, role, journal position); written at
        the next tick."""
        with self._lock:
            self._seat = msgspec.structs.replace(self._seat, **changes)

    def run(self, stop: threading.Event) -> None:
        watchdog = threading.Thread(target=self._watch, args=(stop,), name="election-watchdog", daemon=True)
        watchdog.start()
        try:
            while not stop.is_set() and self.state.role != Role.DEPOSED:
                try:
                    self._tick()
                    self._set(etcd_error="")
                except EtcdUnavailable as e:
                    if not self.state.etcd_error:
                        logger.warning("group %s: %s", self.store.group, e)
                    self._set(etcd_error=str(e))
                stop.wait(self.tick_s)
        finally:
            if self._lease and self.state.role != Role.DEPOSED:
                try:  # a clean stop hands the leadership over at once instead of after the lease
                    self.store.revoke(self._lease)
                except EtcdUnavailable:
                    pass

    def _tick(self) -> None:
        now = self.clock()
        renewed = False
        if not self._lease:
            self._lease, self._renewed_sent, self._put_seat = self.store.grant(self.ttl_s), now, None
        elif now - self._renewed_sent >= self.ttl_s / 4:
            if self.store.keepalive(self._lease) <= 0:
                self._lease_lost("its etcd lease expired")
                return
            self._renewed_sent, renewed = now, True
            self._set(seats=tuple(sorted(self.store.seats().values(), key=lambda s: s.name)))
        with self._lock:
            seat = self._seat
            if self._state.role == Role.LEADER:
                self._valid_until = self._renewed_sent + self.ttl_s - self.margin_s
                self._state = replace(self._state, valid_until=self._valid_until)
        seat = msgspec.structs.replace(seat, role=self.state.role.value)
        if self.state.role == Role.LEADER and not renewed and seat == self._put_seat:
            return  # a leader checks its key with each keepalive, not every tick: less etcd traffic
        if seat != self._put_seat:
            self.store.put(self.store.prefix + "members/" + seat.name, msgspec.json.encode(seat), self._lease)
            self._put_seat = seat
        held = self.store.campaign(msgspec.structs.replace(seat, role=Role.LEADER.value), self._lease)
        if held is None:
            return
        if held.lease == self._lease:
            leader_seat = msgspec.structs.replace(seat, role=Role.LEADER.value)
            if msgspec.json.decode(held.value, type=Seat) != leader_seat:
                self.store.replace_if_held(self.store.leader_key, msgspec.json.encode(leader_seat), self._lease,
                                           held.create_revision)
            if self.state.role == Role.STANDBY:
                with self._lock:
                    self._valid_until = self._renewed_sent + self.ttl_s - self.margin_s
                self._set(role=Role.LEADER, term=held.create_revision, leader=leader_seat,
                          valid_until=self._valid_until)
                logger.info("group %s: %s leads, term %d", self.store.group, seat.name, held.create_revision)
                self.on_elected(held.create_revision)
            else:
                self._set(leader=leader_seat)
        elif self.state.role == Role.LEADER:
            self._depose(f"the leader key is held under another lease (term {held.create_revision})")
        else:
            self._set(term=held.create_revision, leader=msgspec.json.decode(held.value, type=Seat))

    def _lease_lost(self, why: str) -> None:
        if self.state.role == Role.LEADER:
            self._depose(why)
        self._lease = 0

    def _watch(self, stop: threading.Event) -> None:
        """Depose the leader once its leadership may have lapsed, even while a call to etcd blocks."""
        while not stop.wait(min(self.tick_s, 0.05)):
            state = self.state
            if state.role == Role.DEPOSED:
                return
            with self._lock:
                lapsed = state.role == Role.LEADER and self.clock() >= self._valid_until
            if lapsed:
                self._depose(f"no keepalive of its etcd lease reached etcd for {self.ttl_s - self.margin_s:g}s "
                             f"({state.etcd_error or 'etcd or this process too slow'})")

    def _depose(self, reason: str) -> None:
        with self._lock:
            if self._state.role != Role.LEADER:
                return
            self._state = replace(self._state, role=Role.DEPOSED, deposed_reason=reason)
        logger.error("group %s: no longer the leader (term %d): %s", self.store.group, self.state.term, reason)
        self.on_deposed(reason)

    def _set(self, **changes) -> None:
        with self._lock:
            self._state = replace(self._state, **changes)
