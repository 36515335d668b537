"""The node's share of the expert backup, as its agent holds it: written, announced, served, dropped.

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

    def site(self) -> BackupSite | None:
        return BackupSite(self.node, self.path, self.fetch_addr) if self.path else None

    def build(self, launch: WorkerLaunch, items: list[tuple[int, int]], notify: Callable[[BackupReady], None],
              stopped: threading.Event) -> None:
        """Write the dense weights, then `items` (MoE layer index, expert) in the order given,
        calling `notify` for every piece written. Runs on a thread of its own."""
        reader = CheckpointReader(launch.model_dir, dtype=launch.dtype)
        writer = BackupWriter(reader, items, self.node, dense=True)
        self._guard = guard_backup(writer.path)
        site = BackupSite(self.node, writer.path, self.fetch_addr)
        try:
            writer.write_dense()
            self.path = writer.path
            step = max(1, BACKUP_PIECE_BYTES // reader.expert_nbytes)
            for i in range(0, max(len(items), 1), step):
                if stopped.is_set():
                    self.drop("the agent stopped while it was written")
                    return
                if self.path != writer.path:  # dropped meanwhile (the lease ran out)
                    return
                writer.write_experts(items[i : i + step])
                notify(BackupReady(self.node, site, items[i : i + step], writer.nbytes, len(items)))
        finally:
            writer.close()
        logger.info("node %s: backup of %d experts and the dense weights in %s (%d bytes)", self.node, len(items),
                    writer.path, writer.nbytes)

    def answer(self, msg: BackupFetch | DenseFetch) -> BackupTensors | DenseTensors:
        """The reply to another node's fetch: the tensors, or the reason there are none."""
        if isinstance(msg, DenseFetch):
            if not self.path:
                return DenseTensors({}, "this node holds no dense weights in host memory")
            try:
                return DenseTensors(read_dense(self.path))
            except (OSError, KeyError) as e:
                return DenseTensors({}, str(e))
        if not self.path:
            return BackupTensors(None, None, "this node holds no expert backup")
        try:
            return BackupTensors(*read_backup(self.path, msg.items))
        except (OSError, KeyError) as e:
            return BackupTensors(None, None, str(e))

    def drop(self, why: str, warn: bool = False) -> None:
        """Remove the backup file now and serve no more fetches from it."""
        path, guard, self.path, self._guard = self.path, self._guard, None, None
        if path and os.path.exists(path):
            os.unlink(path)
            logger.log(logging.WARNING if warn else logging.INFO, "node %s: removed its backup file %s: %s",
                       self.node, path, why)
        if guard is not None:
            guard.stdin.close()
            guard.wait()
