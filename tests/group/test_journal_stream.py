"""The journal streamed from the leader to a standby over real ZeroMQ sockets (group/journal_stream.py):
the standby's copy follows every batch and reports its position; one that missed batches asks again
and takes the whole journal; frames without the cluster key, that do not decode, of the wrong socket
or of a deposed term are dropped and counted, and change nothing."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from elastic_ep.group.journal import Admitted, Delivered
from elastic_ep.group.journal_stream import DirectJournalWriter, JournalFollower, bind_journal_socket
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.wire import ClusterKey, rejected_counts
from elastic_ep.wire.journal import JournalBatch, JournalFollow

pytestmark = pytest.mark.timeout(60)

TERM = 7


def until(writer: DirectJournalWriter, predicate, timeout_s: float = 10.0) -> None:
    """Answer the standbys (the leader's journal thread's job) until `predicate()` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        writer.answer()
        time.sleep(0.005)


class Standby:
    """A JournalFollower of node `node` following `addr` in TERM, in a thread; `positions`: what it
    reported (its seat's journal_seq)."""

    def __init__(self, key: ClusterKey, addr: str, node: str = "s1"):
        self.positions: list[int] = []
        self.follower = JournalFollower(key, node, lambda: (addr, TERM), resync_s=0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.follower.run, args=(self.stop, self.positions.append), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def leader():
    key = ClusterKey.generate()
    sock, addr = bind_journal_socket("127.0.0.1")
    writer = DirectJournalWriter(sock, key, TERM)
    standbys: list[Standby] = []

    def follow(node: str = "s1") -> Standby:
        standbys.append(Standby(key, addr, node))
        return standbys[-1]

    yield writer, follow
    for s in standbys:
        s.close()
    sock.close(0)


def test_a_standby_follows_every_batch_and_one_that_missed_some_takes_the_whole_journal(leader):
    writer, follow = leader
    params = SamplingParams(max_tokens=8, seed=3)
    writer.add(Admitted("r1", [1, 2], params, 3, []))
    writer.add(Admitted("r2", [5], params, 4, []))
    assert writer.flush() and writer.seq == 1  # before any standby: it comes with the journal's state
    standby = follow()
    copy = standby.follower
    until(writer, lambda: copy.synced and copy.applied == 1)
    writer.add(Delivered("r1", [10], False))
    writer.add(Delivered("r2", [20], True))
    writer.flush()
    until(writer, lambda: copy.applied == 2)
    assert set(copy.requests) == {"r1"} and copy.requests["r1"].output_token_ids == [10]
    assert standby.positions[-1] == writer.seq == 2  # its seat's journal_seq: the lag /cluster shows is 0

    # batch 3 never reaches it (as when its queue at the leader was full): batch 4 shows the gap
    followers = set(writer.followers)
    writer.followers.clear()
    writer.add(Delivered("r1", [11], False))
    writer.flush()
    writer.followers |= followers
    assert copy.applied == 2  # it lags one batch
    writer.add(Delivered("r1", [12], False))
    writer.flush()
    until(writer, lambda: copy.applied == 4)
    assert copy.resyncs == 1 and copy.requests["r1"].output_token_ids == [10, 11, 12]
    assert copy.requests == writer.requests


def test_frames_that_are_not_the_leaders_are_dropped_and_counted(leader):
    writer, follow = leader
    copy = follow("s2").follower
    until(writer, lambda: copy.synced)
    writer.add(Admitted("r", [1], SamplingParams(), 1, []))
    writer.flush()
    until(writer, lambda: copy.applied == 1)
    before = rejected_counts()
    other = ClusterKey.generate()
    forged = [b"s2", *other.seal(JournalBatch(2, b"\x90"), TERM)]  # another deployment's key
    junk = [b"s2", writer.key.mac(b"\xc1junk", TERM), b"\xc1junk"]  # authenticated, not a message
    wrong = [b"s2", *writer.key.seal(JournalFollow("x"), TERM)]  # a standby's message, not the leader's
    stale = [b"s2", *writer.key.seal(JournalBatch(2, b"\x90"), TERM - 1)]  # a deposed leader's term
    for frames in (forged, junk, wrong, stale, [b"s2", b"one frame"]):
        writer.sock.send_multipart(frames)
    deadline = time.monotonic() + 10
    reasons = ("unauthenticated", "undecodable", "unexpected", "stale_term")
    wanted = {"unauthenticated": 2, "undecodable": 1, "unexpected": 1, "stale_term": 1}
    while {r: rejected_counts().get(("journal", "s2", r), 0) - before.get(("journal", "s2", r), 0)
           for r in reasons} != wanted:
        assert time.monotonic() < deadline, rejected_counts()
        time.sleep(0.01)
    assert copy.applied == 1 and copy.resyncs == 0 and list(copy.requests) == ["r"]

    # and at the leader: a follow without the key is dropped, that peer gets nothing
    intruder = zmq.Context.instance().socket(zmq.DEALER)
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.setsockopt(zmq.IDENTITY, b"intruder")
    intruder.connect(writer.sock.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        intruder.send_multipart(other.seal(JournalFollow("intruder")))
        until(writer, lambda: rejected_counts().get(("journal", "", "unauthenticated"), 0)
              > before.get(("journal", "", "unauthenticated"), 0))
        assert b"intruder" not in writer.followers and b"s2" in writer.followers
    finally:
        intruder.close(0)
