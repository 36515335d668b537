"""What the doctor learns from the ranks' processes on its own machine: psutil state and CPU
use, and Python stacks with `py-spy dump`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psutil

from .diagnose import ProcessInfo

PY_SPY_MISSING = (
    "py-spy is not installed: `pip install py-spy` (in the server's environment), then run the doctor as root "
    "or allow ptrace (sysctl kernel.yama.ptrace_scope=0); py-spy reads stacks of processes on this machine only"
)


def worker_process(pid: int | None, rank_id: int) -> psutil.Process | None:
    """The local process of rank `rank_id` if `pid` is one (its command line is an elastic-ep
    worker of that rank), else None: a pid from a server on another machine means nothing here."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if "elastic_ep.runtime.worker" not in cmdline or f'"rank_id": {rank_id},' not in cmdline:
        return None
    return proc


class LocalProcesses:
    """psutil state of the ranks that run on this machine; `start()` before the sampling
    interval, `read()` after it, so cpu_percent covers the interval."""

    def __init__(self, cluster: dict, local_host: bool):
        self.local_host = local_host
        self.procs = {r["rank_id"]: (r.get("pid"), worker_process(r.get("pid"), r["rank_id"]))
                      for r in cluster.get("ranks", []) if r.get("state") not in ("dead", "fenced")}

    def start(self) -> None:
        for _, proc in self.procs.values():
            if proc is not None:
                try:
                    proc.cpu_percent(None)
                except psutil.Error:
                    pass

    def read(self) -> dict[int, ProcessInfo]:
        out = {}
        for rank_id, (pid, proc) in self.procs.items():
            if proc is None:
                if self.local_host and pid is not None and not psutil.pid_exists(pid):
                    out[rank_id] = ProcessInfo("gone")
                continue
            try:
                out[rank_id] = ProcessInfo(proc.status(), proc.cpu_percent(None))
            except psutil.NoSuchProcess:
                out[rank_id] = ProcessInfo("gone")
            except psutil.Error:
                continue
        return out


def py_spy_path() -> str | None:
    beside_python = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside_python) if beside_python.exists() else None)


def py_spy_dump(pid: int, timeout_s: float = 10.0) -> str:
    """`py-spy dump --nonblocking` of one process (it does not pause the process, so a rank
    that is stopped or inside a collective is read as it is). Raises FileNotFoundError when
    py-spy is missing."""
    exe = py_spy_path()
    if exe is None:
        raise FileNotFoundError(PY_SPY_MISSING)
    try:
        done = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"(py-spy dump of pid {pid} did not finish within {timeout_s}s)"
    return (done.stdout + done.stderr).strip()
