"""The request journal streamed from the leader to the standbys over ZeroMQ (`serve --ha-journal-via
direct`) instead of through etcd: the same entries, batches and snapshots (group/journal.py).

Every controller of the group binds a ROUTER (`bind_journal_socket`, before the election) and names
it in its seat (`Seat.journal`). The leader's journal thread (`DirectJournalWriter`) seals each
batch once with the cluster key in its term and sends it to every standby that follows it; a
standby (`JournalFollower`, a DEALER whose identity is its node) connects to the address the
leader's seat names and sends `JournalFollow`; the leader answers with its whole journal
(`JournalState`), then every batch. Frames are read through an `Inbox` (the MAC first, then exactly
these messages; anything else dropped and counted under socket `journal`) with a `TermFence`, so a
deposed leader's frames are dropped too. A batch that is not the next one (the standby's send
queue at the leader, SEND_HWM batches, was full, or it reconnected) makes the standby ask again (at
most every `resync_s`) and take the state. Its position goes into its seat's `journal_seq`, which
gives /cluster its lag, as on the etcd path.

A new leader takes the journal from its own copy: every batch up to the last one it applied in
order. What it missed and had not yet made up for at the takeover is lost to it: the tokens of the
batches in between are generated again (the same ones: a token is a pure function of seed,
position and history); a request admitted in them is not run on by the new leader (its client's
resume, through the router or by `resume_request_id`, runs it anew from its tokens, exact); one that
finished in them runs again to its end, unattended. Nothing of the journal is in etcd on this path:
a standby started after the leader died has none (the etcd path's journal outlives every
controller), and the cluster record stays in etcd either way (group/record.py)."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from elastic_ep.wire import LEADER_TO_STANDBY, STANDBY_TO_LEADER, ClusterKey, Inbox, TermFence
from elastic_ep.wire.journal import JournalBatch, JournalFollow, JournalState
from elastic_ep.wire.receive import recv_parts, recv_routed

from .journal import JournalCopy, Journaled, LeaderJournal, Snapshot

logger = logging.getLogger(__name__)

SEND_HWM = 1000  # batches queued for one standby (50 s at one per 0.05 s); past that they are dropped: it resyncs
MAX_FRAME_BYTES = 64 << 20  # a journal state of thousands of unfinished long prompts; refused above


def bind_journal_socket(host: str) -> tuple[zmq.Socket, str]:
    """A ROUTER bound on `host` (a free port) and the address standbys connect to."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a standby gone is an error to forget it by, not a silent drop
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a standby that reconnects under its name takes it over
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # only JournalFollow comes in
    return sock, f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"


class DirectJournalWriter(LeaderJournal):
    """The leader's side of the direct path on `sock` (bind_journal_socket), sealing with `key` in
    `term`. Runs on one thread (the socket's): `run` answers the standbys between flushes."""

    def __init__(self, sock: zmq.Socket, key: ClusterKey, term: int, start_seq: int = 0,
                 requests: dict[str, Journaled] | None = None, kept: dict[str, Journaled] | None = None):
        super().__init__(term, start_seq, requests, kept)
        self.sock, self.key = sock, key
        self.inbox = Inbox("journal", STANDBY_TO_LEADER, key)
        self.followers: set[bytes] = set()
        self.dropped_sends = 0  # batches a standby's full queue refused (it resyncs)

    def _ship(self, seq: int, body: bytes) -> None:
        frames = self.key.seal(JournalBatch(seq, body), self.term)
        for identity in list(self.followers):
            self._send(identity, frames)

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_sends += 1
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self.followers.discard(identity)  # disconnected: it asks again when it comes back

    def _wait(self, stop: threading.Event, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                self.answer()
        return stop.is_set()

    def answer(self) -> None:
        """Every JournalFollow waiting: that standby gets the whole journal now, and every batch after."""
        while True:
            try:
                identity, parts = recv_routed(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            if self.inbox.read(parts) is None:
                continue
            self.followers.add(identity)
            self._send(identity, self.key.seal(JournalState(self.seq, self.snapshot()), self.term))


_snapshot = msgspec.msgpack.Decoder(Snapshot)


class JournalFollower(JournalCopy):
    """A standby's copy of the journal over the direct path. `leader()`: the leader's journal address
    and term (None while there is none, or this controller leads); `key`: the cluster key; `node`:
    this controller's name (its identity)."""

    def __init__(self, key: ClusterKey, node: str, leader: Callable[[], tuple[str, int] | None],
                 resync_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.key, self.node, self.leader, self.resync_s, self.clock = key, node, leader, resync_s, clock
        self.inbox = Inbox("journal", LEADER_TO_STANDBY, key, node, TermFence())
        self.following: tuple[str, int] | None = None
        self.synced = False  # applied is the leader's journal as of a state or batch it sent
        self.resyncs = 0
        self._sock: zmq.Socket | None = None
        self._asked = float("-inf")

    def run(self, stop: threading.Event, on_applied: Callable[[int], None], poll_s: float = 0.05) -> None:
        """Follow the leader until `stop`; `on_applied(seq)` when the copy moved on."""
        try:
            while not stop.is_set():
                self.follow(self.leader())
                if self._sock is None:
                    stop.wait(poll_s)
                    continue
                before = self.applied
                if self._sock.poll(int(poll_s * 1000), zmq.POLLIN):
                    self.receive()
                if self.applied != before:
                    on_applied(self.applied)
                if not self.synced and self.clock() - self._asked >= self.resync_s:
                    self._ask()
        finally:
            self.follow(None)

    def follow(self, at: tuple[str, int] | None) -> None:
        """Connect to the leader at (address, term), asking for its journal; None: to nobody."""
        if at == self.following:
            return
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self.following, self.synced = at, False
        if at is None or not at[0]:
            return
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.node.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, 0)  # the leader's SNDHWM bounds what queues
        sock.connect(at[0])
        self._sock = sock
        self._ask()

    def _ask(self) -> None:
        if self._sock is not None:
            self._sock.send_multipart(self.key.seal(JournalFollow(self.node)), zmq.NOBLOCK)
            self._asked = self.clock()

    def receive(self) -> None:
        """Every frame waiting: authenticated, of the leader followed, applied in order."""
        while self._sock is not None:
            try:
                parts = recv_parts(self._sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            message = self.inbox.read(parts)
            if message is None or self.following is None or self.inbox.term != self.following[1]:
                continue
            self._take(message)

    def _take(self, message: JournalState | JournalBatch) -> None:
        try:
            if isinstance(message, JournalState):
                self.load(_snapshot.decode(message.snapshot))
                self.synced = True
            elif self.synced and message.seq == self.applied + 1:
                self.apply_batch(message.seq, message.entries)
            elif self.synced and message.seq > self.applied + 1:
                logger.info("journal: batch %d came after %d; asking the leader for its journal again", message.seq,
                            self.applied)
                self._resync()
        except msgspec.MsgspecError as e:  # the leader's own frame, authenticated: not of this version
            logger.warning("journal: a batch of the leader does not decode (%s); asking for its journal again", e)
            self._resync()

    def _resync(self) -> None:
        self.synced = False
        self.resyncs += 1
        self._ask()
