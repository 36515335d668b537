"""A single-member etcd (Debian's `etcd-server`, /usr/bin/etcd) as a child process, for tests and
benchmarks of the controller group: free ports, a temporary data directory, stopped and removed by
`stop()`. `pause()`/`resume()` (SIGSTOP/SIGCONT) make it unreachable without losing its state, the
fault of "etcd unreachable for longer than the lease"."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from .server_process import free_port, terminate

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def etcd_available() -> bool:
    return Path(ETCD).exists()


class EtcdProcess:
    """One etcd listening for clients on http://`host`:<free port> (`url`). `popen` starts it (a
    test bed host's, to run it in a network namespace)."""

    def __init__(self, host: str = "127.0.0.1", popen=subprocess.Popen, ready_timeout_s: float = 20.0):
        self.host = host
        self.data_dir = Path(tempfile.mkdtemp(prefix="elastic-ep-etcd-"))
        client, peer = free_port(host), free_port(host)
        self.url = f"http://{host}:{client}"
        peer_url = f"http://{host}:{peer}"
        self._log = open(self.data_dir / "etcd.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = popen(
            [ETCD, "--name", "e0", "--data-dir", str(self.data_dir / "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"e0={peer_url}", "--initial-cluster-state", "new"],
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"etcd not healthy within {timeout_s}s:\n{self.log()[-2000:]}")

    def log(self) -> str:
        self._log.flush()
        return (self.data_dir / "etcd.log").read_text()

    def pause(self) -> None:
        """SIGSTOP: clients time out, the state (and the leases' deadlines, which resume counting
        on SIGCONT) kept."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        terminate(self.proc, 5.0)
        self._log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)
