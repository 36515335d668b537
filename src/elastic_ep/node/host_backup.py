"""The node's share of the expert backup, as its agent holds it: written, announced, served, dropped.

Read once, copy many at the first start (`WorkerLaunch.read_once`): before the node's first
ranks start, `stage_dense` reads the dense weights into a file of their own in /dev/shm, and the
ranks map them from there instead of each reading the checkpoint; the backup is then assigned
before the first epoch, whose ranks fill their slots from it (this node's file, or another node's
agent). The agent's one reader (`reader`) reads the checkpoint for both; the backup takes its
dense weights from the staged file, which goes once the backup holds them.

The controller assigns the share (`BackupAssign`); `build` writes the dense weights and then the
experts in the order given (the fewest copies first) into one file in /dev/shm
(node/backup_file.py), announcing each piece (`BackupReady`) as soon as it is written, so a
fault soon after start restores from what is already there. `answer` serves other nodes'
`BackupFetch` and `DenseFetch`. `drop` removes the file at once: when the agent stops, when the
controller's connection closes (a new controller assigns a new backup), when the node fences
itself (its lease ran out, so the controller plans nothing from it any more). A guard process
removes it if the agent itself dies, however it ends.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.read_throttle import ReadThrottle
from elastic_ep.wire import (
    BackupFetch,
    BackupReady,
    BackupSite,
    BackupTensors,
    DenseFetch,
    DenseTensors,
    WorkerLaunch,
)

from .backup_file import BackupWriter, guard_backup, read_backup, read_dense

logger = logging.getLogger(__name__)

# Experts per announcement of the backup being written: small enough that a fault soon after
# start finds most of the single-copy experts already in host memory.
BACKUP_PIECE_BYTES = 64 * 2**20


class HostBackup:
    """node: this failure domain's name; fetch_addr: where other nodes ask the agent for it."""

    def __init__(self, node: str, fetch_addr: str):
        self.node = node
        self.fetch_addr = fetch_addr
        self.path: str | None = None  # set once the dense weights are in: restarts may read them
        self._guard: subprocess.Popen | None = None
        self.dense_path: str | None = None  # the staged dense weights, until the backup holds them
        self._dense_guard: subprocess.Popen | None = None
        self._reader: CheckpointReader | None = None

    def reader(self, launch: WorkerLaunch) -> CheckpointReader:
        """The agent's one reader of the checkpoint (its reads are what this node's agent takes from storage)."""
        if self._reader is None:
            self._reader = CheckpointReader(launch.model_dir, dtype=launch.dtype,
                                            throttle=ReadThrottle(launch.read_rate_path, launch.read_rate_mb_s))
        return self._reader

    @property
    def storage_bytes(self) -> int:
        return self._reader.bytes_read if self._reader is not None else 0

    def site(self) -> BackupSite | None:
        """Where this node's ranks get their dense weights in host memory (None: nowhere yet)."""
        path = self.path or self.dense_path
        return BackupSite(self.node, path, self.fetch_addr) if path else None

    def stage_dense(self, launch: WorkerLaunch) -> None:
        """Read the dense weights into a file of their own in /dev/shm, for the node's first ranks."""
        writer = BackupWriter(self.reader(launch), [], self.node, dense=True)
        guard = guard_backup(writer.path)
        try:
            writer.write_dense()
        finally:
            writer.close()
        self.dense_path, self._dense_guard = writer.path, guard
        logger.info("node %s: dense weights read once into %s (%d bytes) for the ranks of this node", self.node,
                    writer.path, writer.nbytes)

    def build(self, launch: WorkerLaunch, items: list[tuple[int, int]], device_kind: str,
              notify: Callable[[BackupReady], None], stopped: threading.Event) -> None:
        """Write the dense weights, then `items` (MoE layer index, expert) in the order given,
        calling `notify` for every piece written with the checksums of its experts as read (of
        the kind ranks on `device_kind` take). Runs on a thread of its own."""
        reader = self.reader(launch)
        staged = self.dense_path
        writer = BackupWriter(reader, items, self.node, dense=True, dense_state=read_dense(staged) if staged else None)
        self._guard = guard_backup(writer.path)
        site = BackupSite(self.node, writer.path, self.fetch_addr)
        try:
            writer.write_dense()
            self.path = writer.path
            self._drop_staged()
            step = max(1, BACKUP_PIECE_BYTES // reader.expert_nbytes)
            for i in range(0, max(len(items), 1), step):
                if stopped.is_set():
                    self.drop("the agent stopped while it was written")
                    return
                if self.path != writer.path:  # dropped meanwhile (the lease ran out)
                    return
                checksums = writer.write_experts(items[i : i + step], device_kind)
                notify(BackupReady(self.node, site, items[i : i + step], writer.nbytes, len(items), checksums))
        finally:
            writer.close()
        logger.info("node %s: backup of %d experts and the dense weights in %s (%d bytes)", self.node, len(items),
                    writer.path, writer.nbytes)

    def answer(self, msg: BackupFetch | DenseFetch) -> BackupTensors | DenseTensors:
        """The reply to another node's fetch: the tensors, or the reason there are none."""
        if isinstance(msg, DenseFetch):
            path = self.path or self.dense_path
            if not path:
                return DenseTensors({}, "this node holds no dense weights in host memory")
            try:
                return DenseTensors(read_dense(path))
            except (OSError, KeyError) as e:
                return DenseTensors({}, str(e))
        if not self.path:
            return BackupTensors(None, None, "this node holds no expert backup")
        try:
            return BackupTensors(*read_backup(self.path, msg.items))
        except (OSError, KeyError) as e:
            return BackupTensors(None, None, str(e))

    def drop(self, why: str, warn: bool = False) -> None:
        """Remove the backup file (and the staged dense weights) now and serve no more fetches from them."""
        path, guard, self.path, self._guard = self.path, self._guard, None, None
        if _remove(path, guard):
            logger.log(logging.WARNING if warn else logging.INFO, "node %s: removed its backup file %s: %s",
                       self.node, path, why)
        self._drop_staged()

    def _drop_staged(self) -> None:
        """Remove the staged dense weights (the backup holds them now, or it is dropped)."""
        path, guard, self.dense_path, self._dense_guard = self.dense_path, self._dense_guard, None, None
        _remove(path, guard)


def _remove(path: str | None, guard: subprocess.Popen | None) -> bool:
    """Remove a file of this agent's and let its guard go; whether there was a file."""
    removed = bool(path) and os.path.exists(path)
    if removed:
        os.unlink(path)
    if guard is not None:
        guard.stdin.close()
        guard.wait()
    return removed
