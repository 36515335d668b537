"""`elastic-ep serve` as a child process: start on a free port, wait until ready, stop.

For end-to-end tests, benchmarks and demos. The server's workers die with it (they are its
children and exit when their parent does), so stopping the server leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from elastic_ep.wire import ClusterKey


def running(pid: int) -> bool:
    """Whether process `pid` is still running (a zombie, exited but not reaped, is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes_left(pids: set[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still running after up to `timeout_s` (polled; workers exit shortly after their
    server). By pid, not `Popen.wait`/`Process.join`: another thread may reap the process first."""
    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(p for p in pids if running(p))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after grace_s; returns once the process is reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """One `elastic-ep serve ARGS` process with its output in `log_path`, listening on `host`.

    ready_timeout_s: how long to wait for GET /ready to answer 200 (default 120 s); None: do not
    wait (call `wait_ready` later, e.g. after starting agents on other nodes). `popen` starts
    the process (e.g. a test bed host's, to run it in a network namespace; then give `port`).
    env: variables set for the server on top of this process's (e.g. PYTHONPATH of another
    source tree). The cluster key is written beside the log (`key_file`: give it to agents);
    `admin_api_key` / `api_key` start it with those keys, which `http` then sends (the admin
    key, which /v1 takes too, when both are given). own_group: start it in a process group of
    its own, so that `kill_group` can kill the server and its workers at once (an instance's
    death, for the router's tests).
    """

    def __init__(self, args: list[str], log_path: str | Path, ready_timeout_s: float | None = 120.0,
                 host: str = "127.0.0.1", port: int | None = None, popen=subprocess.Popen,
                 env: dict[str, str] | None = None, api_key: str | None = None, admin_api_key: str | None = None,
                 own_group: bool = False):
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path)
        self.key_file = self.log_path.with_name(self.log_path.name + ".cluster.key")
        self.key_file.unlink(missing_ok=True)
        ClusterKey.generate().write(self.key_file)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        keys = [*(["--api-key", api_key] if api_key else []),
                *(["--admin-api-key", admin_api_key] if admin_api_key else [])]
        self.proc = popen(
            [sys.executable, "-m", "elastic_ep.cli", "serve", "--host", host, "--port", str(self.port),
             "--cluster-key-file", str(self.key_file), *keys, *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, **({"start_new_session": True} if own_group else {}),
        )
        bearer = admin_api_key or api_key
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        self.http = httpx.Client(base_url=self.url, timeout=60, headers=headers)
        if ready_timeout_s is not None:
            try:
                self.wait_ready(ready_timeout_s)
            except BaseException:  # nobody holds this object yet to stop it
                self.stop()
                raise

    def controller_addr(self, timeout_s: float = 60.0) -> str:
        """The address agents of other nodes connect to (`elastic-ep agent --controller`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self.http.get("/cluster").json()["controller"]
            except (httpx.TransportError, ValueError, KeyError):
                time.sleep(0.1)
        raise TimeoutError(f"no controller address within {timeout_s}s:\n{self.log()[-3000:]}")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Raise RuntimeError if the server exits, TimeoutError if not ready within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.http.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready within {timeout_s}s:\n{self.log()[-3000:]}")

    def wait_for(self, predicate, timeout_s: float = 30.0, what: str = "condition") -> dict:
        """Poll /cluster until predicate(cluster) holds; returns that cluster JSON."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cluster = self.cluster()
            if predicate(cluster):
                return cluster
            time.sleep(0.05)
        raise TimeoutError(f"{what} not reached within {timeout_s}s: {json.dumps(self.cluster())[:3000]}")

    def wait_full_group(self, ep_size: int, timeout_s: float = 60.0) -> dict:
        """Wait until `ep_size` ranks serve, the server is ready and no background rebalance is
        under way (a fault injected next lands in a quiet group)."""
        return self.wait_for(
            lambda c: c["ready"] and len(c["members"]) == ep_size and all(r["state"] == "serving" for r in c["ranks"])
            and not c.get("rebalance", {}).get("active"),
            timeout_s, f"all {ep_size} ranks serving",
        )

    def cluster(self) -> dict:
        return self.http.get("/cluster").json()

    def pids(self) -> dict[int, int]:
        """rank_id -> pid of every serving rank."""
        return {r["rank_id"]: r["pid"] for r in self.cluster()["ranks"] if r["state"] == "serving"}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def kill_group(self) -> None:
        """SIGKILL the server's whole process group (its workers too); needs own_group."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after grace_s."""
        terminate(self.proc, grace_s)
        self.http.close()
        self._log.close()
