"""`elastic-ep router` as a child process on a free port, for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from elastic_ep.harness.server_process import free_port, terminate


class RouterProcess:
    """One `elastic-ep router ARGS` process (backends among ARGS) with its output in `log_path`;
    waits until it answers /health (start_timeout_s)."""

    def __init__(self, args: list[str], log_path: str | Path, start_timeout_s: float = 120.0,
                 host: str = "127.0.0.1"):
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_ep.cli", "router", "--host", host, "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.http = httpx.Client(base_url=self.url, timeout=60)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"router not up within {start_timeout_s}s:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def backends(self) -> dict[str, dict]:
        """url -> the router's view of that backend (GET /backends)."""
        return {b["url"]: b for b in self.http.get("/backends").json()}

    def wait_ready_backend(self, url: str, timeout_s: float = 60.0) -> None:
        """Until the router has polled the backend at `url` and found it ready."""
        deadline = time.monotonic() + timeout_s
        while not self.backends()[url]["ready"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router found {url} not ready within {timeout_s}s")
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        """The value of an unlabelled sample of the router's /metrics (0 when absent)."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, grace_s: float = 10.0) -> None:
        terminate(self.proc, grace_s)
        self.http.close()
        self._log.close()
