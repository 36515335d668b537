"""A worker's exit is seen, with its code, from the moment it begins until its parent reaps it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from elastic_ep.node.exits import exit_code, open_stat


def exit_seen(fd: int, timeout_s: float = 10.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = exit_code(fd)
        if code is not None:
            return code
        time.sleep(0.001)
    return None


def test_a_killed_process_reads_as_exiting_with_its_signal_until_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fd = open_stat(proc.pid)
    try:
        assert exit_code(fd) is None
        os.kill(proc.pid, signal.SIGKILL)
        assert exit_seen(fd) == -signal.SIGKILL
        proc.wait()
        assert exit_code(fd) is None  # reaped: its wait() reports it, and the pid may be reused
    finally:
        os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_exit_code_reads_as_that_code():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    fd = open_stat(proc.pid)
    try:
        assert exit_seen(fd) == 3
    finally:
        proc.wait()
        os.close(fd)
