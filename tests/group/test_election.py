"""Leader election against a real etcd (harness/etcd.py): one leader, terms that only rise, a
takeover once the leader's lease runs out, and no second leader while etcd is unreachable; a
controller whose --ha-journal-via is not its group's refused."""

import os
import subprocess
import sys
import threading
import time

import pytest

from elastic_ep.commands.serve_group import journal_via_conflict
from elastic_ep.group.election import Election, Role
from elastic_ep.group.status import group_view
from elastic_ep.group.store import GroupStore, Seat

pytestmark = pytest.mark.timeout(60)


class Running:
    """An Election in its thread, with the times it was elected and deposed."""

    def __init__(self, url: str, name: str, group: str = "g", **kwargs):
        self.elected_at: float | None = None
        self.deposed: str | None = None
        self.stop = threading.Event()
        self.election = Election(GroupStore(url, group, timeout_s=0.5), Seat(name, f"http://{name}:1"),
                                 on_elected=self._elected, on_deposed=self._deposed, **kwargs)
        self.thread = threading.Thread(target=self.election.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def _elected(self, term: int) -> None:
        self.elected_at = time.monotonic()

    def _deposed(self, reason: str) -> None:
        self.deposed_at = time.monotonic()
        self.deposed = reason

    def halt(self) -> None:
        self.stop.set()
        self.thread.join(5)


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


CHILD = """
import sys, threading
from elastic_ep.group.election import Election
from elastic_ep.group.store import GroupStore, Seat
e = Election(GroupStore(sys.argv[1], "g", timeout_s=0.5), Seat("a", "http://a:1"),
             on_elected=lambda term: print("elected", term, flush=True))
e.run(threading.Event())
"""


def test_one_leads_the_other_stands_by_and_takes_over_with_a_higher_term(etcd):
    a = subprocess.Popen([sys.executable, "-c", CHILD, etcd.url], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        first = int(a.stdout.readline().split()[1])  # "elected <term>"
        b = Running(etcd.url, "b")
        try:
            wait_until(lambda: b.election.state.leader is not None and len(b.election.state.seats) == 2)
            assert b.election.state.role == Role.STANDBY and b.election.state.term == first
            assert b.election.state.leader.name == "a"
            view = group_view("g", etcd.url, "b", b.election.state)
            assert view["leader"]["name"] == "a" and view["role"] == "standby"
            assert {m["name"]: m["role"] for m in view["members"]} == {"a": "leader", "b": "standby"}
            a.kill()  # SIGKILL: its lease is left to run out at etcd
            a.wait()
            lost_at = time.monotonic()
            wait_until(lambda: b.election.state.role == Role.LEADER, 10)
            assert b.election.state.term > first
            assert b.elected_at - lost_at < 2 + 1.5  # the lease (2 s), a campaign tick and etcd's lease slack
        finally:
            b.halt()
    finally:
        a.kill()
        a.wait()


def leader_and_standby(url: str) -> tuple[Running, Running]:
    """a leading, b standing by and knowing it."""
    a = Running(url, "a")
    wait_until(lambda: a.election.state.role == Role.LEADER)
    b = Running(url, "b")
    wait_until(lambda: b.election.state.leader is not None)
    return a, b


def test_a_clean_stop_hands_over_at_once(etcd):
    a, b = leader_and_standby(etcd.url)
    try:
        a.halt()  # revokes its lease
        stopped = time.monotonic()
        wait_until(lambda: b.election.state.role == Role.LEADER, 5)
        assert b.elected_at - stopped < 1.0
    finally:
        b.halt()


def test_etcd_unreachable_longer_than_the_lease_never_yields_two_leaders(etcd):
    a, b = leader_and_standby(etcd.url)
    try:
        etcd.pause()  # SIGSTOP: every call to etcd times out
        wait_until(lambda: a.deposed is not None, 5)
        # the leader gave up before its lease could have run out at etcd: within the 2 s lease of the
        # send of its last keepalive that etcd answered (valid_until is that less the 0.25 s margin)
        assert a.deposed_at < a.election.state.valid_until + 0.25
        assert "keepalive" in a.deposed
        assert a.election.state.role == Role.DEPOSED and b.election.state.role == Role.STANDBY
        time.sleep(1.0)  # well past the lease
        assert b.election.state.role == Role.STANDBY and b.election.state.etcd_error
        etcd.resume()
        wait_until(lambda: b.election.state.role == Role.LEADER, 10)
        assert a.election.state.role == Role.DEPOSED  # never leads again
    finally:
        etcd.resume()
        a.halt()
        b.halt()


def test_a_deposed_leader_whose_key_was_taken_steps_down(etcd):
    a = Running(etcd.url, "a")
    try:
        wait_until(lambda: a.election.state.role == Role.LEADER)
        store = GroupStore(etcd.url, "g")
        store.revoke(a.election._lease)  # its lease and key gone at etcd, as after a long pause of a's host
        b = Running(etcd.url, "b")
        wait_until(lambda: b.election.state.role == Role.LEADER or a.deposed is not None, 10)
        wait_until(lambda: a.deposed is not None, 10)
        assert a.election.state.role == Role.DEPOSED
        b.halt()
    finally:
        a.halt()


def test_the_journal_way_of_a_controller_must_be_its_groups():
    direct, etcd_way = Seat("c0", "http://c0:1", role="leader", journal="tcp://c0:7"), Seat("c1", "http://c1:1")
    assert direct.journal_via == "direct" and etcd_way.journal_via == "etcd"
    conflict = journal_via_conflict("etcd", "g", "c2", [direct, etcd_way])
    assert conflict is not None and "controller c0 of group g (leader) runs with --ha-journal-via direct" in conflict
    assert "start this controller with --ha-journal-via direct" in conflict
    assert "--ha-journal-via etcd" in journal_via_conflict("direct", "g", "c2", [etcd_way])
    assert journal_via_conflict("direct", "g", "c2", [direct]) is None
    assert journal_via_conflict("etcd", "g", "c0", [direct]) is None  # its own seat, from before a restart


def test_serve_journaling_another_way_than_its_groups_leader_exits_2_saying_which_flag(etcd, tmp_path):
    leader = Running(etcd.url, "c0")  # a leader that streams its journal (a seat with a journal socket)
    leader.election.set_seat(journal="tcp://127.0.0.1:9")
    try:
        wait_until(lambda: leader.election.state.role == Role.LEADER and leader.election.state.leader.journal)
        proc = subprocess.run(
            [sys.executable, "-m", "elastic_ep.cli", "serve", "--model", "tiny-deepseek-v3", "--ep-size", "2",
             "--port", "0", "--etcd", etcd.url, "--ha-group", "g", "--node", "c1"],
            capture_output=True, text=True, timeout=50, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "start this controller with --ha-journal-via direct" in proc.stderr
        assert [s.name for s in GroupStore(etcd.url, "g").seats().values()] == ["c0"]  # it never took a seat
    finally:
        leader.halt()
