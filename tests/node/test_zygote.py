"""The worker zygote (node/zygote.py) with real processes: a forked process runs its target on its
argv with the stdin it was given, only once released, shows its title, is this process's child
(its exit status read as from Popen, a kill included), and outlives the zygote; a fork the kernel
refuses (the zygote's pids limit) is an OSError with the kernel's reason, and the zygote forks
again once the limit is lifted; the code fingerprint sees an edit."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from elastic_ep.node.zygote import Zygote, source_fingerprint
from elastic_ep.parent_death import adopt_orphans

CHILD = textwrap.dedent("""
    import os, sys

    def main(argv):
        out = open(argv[0], "w")
        out.write(f"{os.getpid()} {os.getppid()} {sys.stdin.buffer.read().decode()}")
        out.close()
        if argv[1] == "sleep":
            import time
            time.sleep(60)
        return int(argv[1])

    def env(argv):
        open(argv[0], "w").write(os.environ.get(argv[1], "(unset)"))
        return 0
""")


@pytest.fixture
def zygote(tmp_path):
    assert adopt_orphans()  # what the agent does: its forked workers become its children
    (tmp_path / "child_mod.py").write_text(CHILD)
    z = Zygote({**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}, preload=("child_mod",))
    assert z.wait_ready(60), "the zygote did not import its preload in 60 s"
    yield z
    z.close()


def test_a_forked_process_runs_its_target_once_released_as_a_child_of_ours(zygote, tmp_path):
    out = tmp_path / "out"
    worker = zygote.fork("child_mod:main", [str(out), "7"], "elastic-ep test child")
    assert psutil.Process(worker.pid).ppid() == os.getpid()  # adopted before its pid was told
    time.sleep(0.3)
    assert not out.exists()  # held on its go pipe until released
    worker.release()
    worker.stdin.write(b"on stdin")
    worker.stdin.close()
    assert worker.wait() == 7
    pid, ppid, said = out.read_text().split(" ", 2)
    assert (int(pid), int(ppid), said) == (worker.pid, os.getpid(), "on stdin")


def test_a_forks_env_is_added_to_that_worker_only_and_never_to_the_zygote(zygote, tmp_path):
    """The cluster key travels this way (the zygote starts before the command has read it)."""
    for i, env in enumerate(({"EEP_TEST_SECRET": "s3cret"}, None)):
        worker = zygote.fork("child_mod:env", [str(tmp_path / f"out{i}"), "EEP_TEST_SECRET"], "env", env)
        worker.release()
        worker.stdin.close()
        assert worker.wait() == 0
    assert (tmp_path / "out0").read_text() == "s3cret"
    assert (tmp_path / "out1").read_text() == "(unset)"  # the first fork's env did not stay in the zygote
    assert b"EEP_TEST_SECRET" not in Path(f"/proc/{zygote.proc.pid}/environ").read_bytes()


def test_exit_by_signal_title_and_a_timed_wait(zygote, tmp_path):
    worker = zygote.fork("child_mod:main", [str(tmp_path / "out"), "sleep"], "elastic-ep test sleeper")
    worker.release()
    worker.stdin.close()
    deadline = time.monotonic() + 30
    while not (tmp_path / "out").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert Path(f"/proc/{worker.pid}/cmdline").read_bytes().rstrip(b"\0 ").decode() == "elastic-ep test sleeper"
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(0.2)
    os.kill(worker.pid, signal.SIGKILL)
    assert worker.wait() == -signal.SIGKILL


def test_a_process_never_released_ends_when_waited_for(zygote, tmp_path):
    worker = zygote.fork("child_mod:main", [str(tmp_path / "out"), "0"], "never released")
    assert worker.wait() == 1 and not (tmp_path / "out").exists()


def test_forked_processes_outlive_the_zygote(zygote, tmp_path):
    worker = zygote.fork("child_mod:main", [str(tmp_path / "out"), "sleep"], "outlives")
    worker.release()
    worker.stdin.close()
    os.kill(zygote.proc.pid, signal.SIGKILL)
    zygote.proc.wait()
    assert not zygote.ready
    time.sleep(0.3)
    assert psutil.Process(worker.pid).status() != psutil.STATUS_ZOMBIE
    with pytest.raises(ConnectionError, match="gone"):
        zygote.fork("child_mod:main", [str(tmp_path / "other"), "0"], "after")
    os.kill(worker.pid, signal.SIGKILL)
    assert worker.wait() == -signal.SIGKILL


def pids_cgroup(name: str) -> Path | None:
    """A new cgroup of the pids controller (v1 of a hybrid host, or v2 with pids enabled), or None."""
    v1, v2 = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")
    for parent in (v1, v2):
        if parent == v1 and (v1 / "tasks").exists() or parent == v2 and (v2 / "cgroup.subtree_control").exists() \
                and "pids" in (v2 / "cgroup.subtree_control").read_text().split():
            try:
                (parent / name).mkdir()
            except OSError:
                return None
            return parent / name
    return None


def test_a_fork_the_pids_limit_refuses_is_an_os_error_and_the_zygote_forks_again(zygote, tmp_path):
    group = pids_cgroup(f"elastic-ep-test-{os.getpid()}")
    if group is None:
        pytest.skip("no writable pids cgroup on this host")
    try:
        (group / "pids.max").write_text("1")
        (group / "cgroup.procs").write_text(str(zygote.proc.pid))
        with pytest.raises(OSError) as refused:
            zygote.fork("child_mod:main", [str(tmp_path / "out"), "0"], "refused")
        assert refused.value.errno == errno.EAGAIN and "Resource temporarily unavailable" in str(refused.value)
        assert zygote.ready
        (group / "pids.max").write_text("max")
        worker = zygote.fork("child_mod:main", [str(tmp_path / "out"), "3"], "forked again")
        worker.release()
        worker.stdin.close()
        assert worker.wait() == 3
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (group.parent / "cgroup.procs").write_text(pid)
        group.rmdir()


def test_the_fingerprint_sees_an_edit_an_added_and_a_removed_file(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    first = source_fingerprint(tmp_path)
    assert source_fingerprint(tmp_path) == first
    os.utime(tmp_path / "a.py", ns=(first[1] + 10**9, first[1] + 10**9))
    edited = source_fingerprint(tmp_path)
    assert edited != first
    (tmp_path / "b.py").write_text("")
    os.utime(tmp_path / "b.py", ns=(first[1], first[1]))
    added = source_fingerprint(tmp_path)
    assert added[0] == 2 and added != edited
    (tmp_path / "b.py").unlink()
    assert source_fingerprint(tmp_path) == edited


def test_a_zygote_whose_preload_starts_a_thread_never_becomes_ready(tmp_path):
    (tmp_path / "threaded_mod.py").write_text("import threading, time\n"
                                              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    z = Zygote({**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"},
               preload=("threaded_mod",))
    try:
        assert not z.wait_ready(60)
        assert z.proc.wait(10) != 0  # it exited, naming the thread on its stderr
    finally:
        z.close()
