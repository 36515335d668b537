"""Storage reads held to a rate shared by every process that reads (`--load-read-rate-mb-s`), so
the read storm of a cold start can be measured on one machine: the processes of a host take turns
on one simulated link instead of each getting the rate alone.

Every read reserves `nbytes / rate` seconds of the link, starting when the reservations before it
end (the end of the last one is kept in a small file all of them lock, `path`), then waits until
its own reservation ends. N readers at once therefore take N times as long as one, as they would
on storage of that bandwidth.
"""

from __future__ import annotations

import fcntl
import os
import struct
import tempfile
import time

MB = 10**6


class ReadThrottle:
    """rate_mb_s: the shared rate in MB/s (0 or less: reads are not held back); path: the file the
    readers share, which the server that sets the rate creates and removes (`create_rate_file`)."""

    def __init__(self, path: str, rate_mb_s: float):
        self.path, self.rate_mb_s = path, rate_mb_s
        self.waited_s = 0.0

    @property
    def active(self) -> bool:
        return self.rate_mb_s > 0 and bool(self.path)

    def charge(self, nbytes: int) -> None:
        """Wait for this read's turn on the link: until nbytes at the rate have passed after the reads before it."""
        if not self.active or nbytes <= 0:
            return
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:  # its server stopped: nothing left to share the rate with
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 8, 0)
            free_at = struct.unpack("<d", raw)[0] if len(raw) == 8 else 0.0
            now = time.time()
            done_at = max(now, free_at) + nbytes / (self.rate_mb_s * MB)
            os.pwrite(fd, struct.pack("<d", done_at), 0)
        finally:
            os.close(fd)  # the lock goes with it
        wait_s = done_at - time.time()
        if wait_s > 0:
            self.waited_s += wait_s
            time.sleep(wait_s)


def create_rate_file() -> str:
    """A new, empty file for readers to share a throttle through (the caller removes it)."""
    fd, path = tempfile.mkstemp(prefix="elastic-ep-read-rate-")
    os.close(fd)
    return path
