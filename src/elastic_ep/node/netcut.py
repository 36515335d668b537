"""Cutting a rank's (or a whole node's) network links on request (`chaos cut` / `chaos heal`), on
any host, loopback included: the process keeps running, but no packet of its sockets goes in or
out, as when its link is cut.

Each worker starts in a cgroup v2 directory of its own under the agent's
(`<cgroup2>/elastic-ep-<agent pid>/rank<R>`); a standalone agent moves itself into
`.../agent` first, so its node's cgroup holds it and its ranks. A cut is an nftables table with
an input and an output rule dropping every packet whose socket belongs to that cgroup
(`socket cgroupv2`); healing deletes the table. Peers see silence and time out (no reset),
connections resume after the heal if their owners have not given up.

Needs cgroup v2 mounted and writable and the `nft` command (as the network test bed does);
without them a cut is refused with the reason, and workers run where they would have.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")  # where nft resolves cgroup paths from


class NetCutUnavailable(RuntimeError):
    """This host cannot cut links (no writable cgroup v2 or no nft): the message says which."""


def cgroup2_root() -> Path | None:
    """The cgroup v2 mount point (pure v2, or the `unified` mount of a hybrid), or None."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            return Path(left.split()[4])
    return None


def cut_unavailable() -> str:
    """Why links cannot be cut on this host ("" when they can)."""
    root = cgroup2_root()
    if root is None:
        return "no cgroup v2 mount on this host"
    if shutil.which("nft") is None:
        return "no `nft` command (apt-get install nftables)"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable; needs root"
    return ""


class NetCut:
    """The cgroups and cut rules of one agent's processes. `scope`: e.g. the agent's pid."""

    def __init__(self, scope: str):
        root = cgroup2_root()
        self.base = root / f"elastic-ep-{scope}" if root is not None else None
        self.table_prefix = f"eepcut{scope}"
        # place (the agent's thread) and remove (a worker's waiter) of the same name: a rank's new
        # process starts while its old one's waiter may still be removing the cgroup they share
        self._lock = threading.Lock()
        self.reason = cut_unavailable()
        if not self.reason:
            try:
                self.base.mkdir(exist_ok=True)
            except OSError as e:
                self.reason = f"cannot create {self.base} ({e.strerror})"

    def place(self, name: str, pid: int) -> None:
        """Move process `pid` into the cgroup `name`, before it opens sockets: a socket belongs
        to the cgroup its process was in when it was created. Raises NetCutUnavailable when the
        kernel refuses (the process then runs, uncuttable, where it was started)."""
        if self.reason:
            return
        path = self.base / name
        with self._lock:
            try:
                path.mkdir(exist_ok=True)
                (path / "cgroup.procs").write_text(str(pid))
            except OSError as e:
                raise NetCutUnavailable(f"cannot move pid {pid} into {path} ({e.strerror})") from None

    def remove(self, name: str) -> None:
        """Heal and remove the cgroup of a process that exited, unless another process is in it
        already (the rank's next process, started before this one's exit was seen): that one
        keeps its cgroup, and its cut."""
        if self.reason:
            return
        with self._lock:
            try:
                (self.base / name).rmdir()
            except OSError as e:
                if e.errno == errno.EBUSY:
                    return
            self.heal(name)

    def cut(self, name: str | None) -> None:
        """Drop every packet of the sockets in cgroup `name` (None: the whole agent's cgroup)."""
        if self.reason:
            raise NetCutUnavailable(f"cannot cut links here: {self.reason}")
        path = self.base if name is None else self.base / name
        if name is not None and not _members(path):
            raise NetCutUnavailable(f"no process is in {path}, so a cut would drop nothing (its process could "
                                    "not be moved there when it started: see the agent's log)")
        level = len(path.relative_to(cgroup2_root()).parts)
        where = str(path.relative_to(CGROUP_FS))
        table = self._table(name)
        script = (f"table inet {table} {{\n"
                  f"  chain in {{ type filter hook input priority -10; "
                  f"socket cgroupv2 level {level} \"{where}\" drop; }}\n"
                  f"  chain out {{ type filter hook output priority -10; "
                  f"socket cgroupv2 level {level} \"{where}\" drop; }}\n"
                  "}\n")
        self.heal(name)
        _nft(["-f", "-"], script)

    def heal(self, name: str | None) -> None:
        """Undo cut(name); nothing to do when it is not cut."""
        if not self.reason:
            _nft(["delete", "table", "inet", self._table(name)], check=False)

    def close(self) -> None:
        """Heal every cut of this agent and remove its (empty) cgroups."""
        if self.reason:
            return
        for line in _nft(["list", "tables"], check=False).splitlines():
            name = line.split()[-1]
            if name.startswith(self.table_prefix):
                _nft(["delete", "table", "inet", name], check=False)
        for path in [*self.base.glob("*/"), self.base]:
            try:
                path.rmdir()
            except OSError:
                pass

    def _table(self, name: str | None) -> str:
        return f"{self.table_prefix}{'node' if name is None else name}"


def _members(path: Path) -> list[str]:
    """The pids in cgroup `path` (none when it does not exist)."""
    try:
        return (path / "cgroup.procs").read_text().split()
    except OSError:
        return []


def _nft(args: list[str], script: str | None = None, check: bool = True) -> str:
    done = subprocess.run(["nft", *args], input=script, capture_output=True, text=True)
    if check and done.returncode:
        raise NetCutUnavailable(f"nft {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout
