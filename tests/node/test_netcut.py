"""The cgroups that let a rank's links be cut (node/netcut.py), on this host's real cgroup v2 and
nftables: a rank's next process, started before its old one's exit is seen, keeps its cgroup and
its cut; a move into a cgroup never races the removal of the same one; a cut of a cgroup with no
process in it is refused."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from elastic_ep.node.netcut import NetCut, NetCutUnavailable, cut_unavailable

pytestmark = pytest.mark.skipif(bool(cut_unavailable()), reason=f"links cannot be cut here: {cut_unavailable()}")


@pytest.fixture
def netcut(request) -> Iterator[NetCut]:
    cut = NetCut(f"test{abs(hash(request.node.name)) % 10**8}")
    try:
        yield cut
    finally:
        cut.close()


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def sleeper(procs: list[subprocess.Popen]) -> subprocess.Popen:
    procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    return procs[-1]


def tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout


def test_the_old_process_removal_leaves_the_next_process_its_cgroup_and_its_cut(netcut, sleepers):
    old = sleeper(sleepers)
    netcut.place("rank2", old.pid)
    old.kill()
    old.wait()
    new = sleeper(sleepers)
    netcut.place("rank2", new.pid)  # the rank's next process, before the old one's waiter removes the cgroup
    netcut.cut("rank2")
    netcut.remove("rank2")  # the old one's waiter, late
    assert (netcut.base / "rank2" / "cgroup.procs").read_text().split() == [str(new.pid)]
    assert f"{netcut.table_prefix}rank2" in tables()  # still cut
    new.kill()
    new.wait()
    netcut.remove("rank2")
    assert not (netcut.base / "rank2").exists() and f"{netcut.table_prefix}rank2" not in tables()


def test_a_move_into_a_cgroup_never_meets_its_removal_half_way(netcut, sleepers):
    """The agent's thread places a rank's new process while a waiter thread removes the cgroup of
    its old one: each move lands in a whole cgroup (before the lock, one in a few hundred met a
    removed one: ENOENT or ENODEV, and the agent died)."""
    proc = sleeper(sleepers)
    stop = threading.Event()

    def remove_again() -> None:
        while not stop.is_set():
            netcut.remove("rank0")

    remover = threading.Thread(target=remove_again)
    remover.start()
    try:
        for _ in range(300):
            netcut.place("rank0", proc.pid)
            netcut.place("elsewhere", proc.pid)  # out again, so the remover can take rank0 away
    finally:
        stop.set()
        remover.join()


def test_a_cut_of_a_cgroup_without_a_process_is_refused(netcut):
    with pytest.raises(NetCutUnavailable, match="no process is in"):
        netcut.cut("rank5")
    assert f"{netcut.table_prefix}rank5" not in tables()
