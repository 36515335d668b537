"""Seeing a process die when its exit begins, not when it ends (Linux).

A killed process is marked exiting (PF_EXITING, with its exit code) within microseconds of the
signal, but its parent's wait() returns only after the kernel has freed all its memory, a time
that grows with the memory it held, so a rank holding gigabytes of experts would be reported
dead hundreds of milliseconds late. Both flags and exit code are in /proc/<pid>/stat from the
start of the exit; an agent polls them.
"""

from __future__ import annotations

import os

PF_EXITING = 0x4  # include/linux/sched.h


def open_stat(pid: int) -> int:
    """A descriptor on /proc/<pid>/stat. It stays bound to that process: once the process is
    reaped it reads an error, never another process that reuses the pid."""
    return os.open(f"/proc/{pid}/stat", os.O_RDONLY)


def exit_code(stat_fd: int) -> int | None:
    """The returncode of a process that has begun to exit, by Popen's convention (-N: killed by
    signal N), or None while it runs. A process already reaped reads as None: its wait() reports it."""
    try:
        data = os.pread(stat_fd, 4096, 0)
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # field 3 (state) onwards; the name may hold spaces
    state, flags = fields[0], int(fields[6])
    if not flags & PF_EXITING and state not in (b"Z", b"X"):
        return None
    status = int(fields[49]) if len(fields) > 49 else 0  # field 52: exit code, as wait() encodes it
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF
