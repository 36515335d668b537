"""Counting the opens of files by any process, from the kernel (inotify), not from the code that opens them.

`FileOpens(directory)` watches a directory from the moment it is built: every open of a file in
it, by any process on the host, is counted by name until `close()`. A test proves with it how
often a checkpoint's shards were really opened (read once, copy many), whatever path the code took.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
from collections import Counter

IN_OPEN = 0x00000020
IN_NONBLOCK = 0o4000
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class FileOpens:
    """Opens of the files of `directory` (not its subdirectories), by file name."""

    def __init__(self, directory: str | os.PathLike):
        self.fd = _libc.inotify_init1(IN_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if _libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch({directory}) failed")
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="file-opens", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            at = 0
            while at < len(data):
                _, mask, _, length = EVENT_HEADER.unpack_from(data, at)
                name = data[at + EVENT_HEADER.size : at + EVENT_HEADER.size + length].rstrip(b"\0").decode()
                at += EVENT_HEADER.size + length
                if mask & IN_OPEN and name:
                    with self._lock:
                        self.counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def close(self) -> dict[str, int]:
        """Stop counting (once; again is a no-op); the counts so far."""
        if self._stop.is_set():
            return self.snapshot()
        self._stop.set()
        self._thread.join()
        os.close(self.fd)
        return self.snapshot()
