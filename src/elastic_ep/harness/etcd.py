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

    def __init__(self, host: str = "127.0.0.1", popen=subprocess.Popen, ready_timeout_s: float = 20.0,
                 tries: int = 3):
        self.host = host
        self.data_dir = Path(tempfile.mkdtemp(prefix="elastic-ep-etcd-"))
        self._log = open(self.data_dir / "etcd.log", "w")  # noqa: SIM115 - closed in stop()
        for attempt in range(tries):  # a free port can be taken by another process before etcd binds it
            self._start(popen)
            try:
                self._wait_ready(ready_timeout_s)
                return
            except RuntimeError as e:
                if "address already in use" not in str(e) or attempt == tries - 1:
                    self.stop()
                    raise
                shutil.rmtree(self.data_dir / "data", ignore_errors=True)
            except BaseException:
                self.stop()
                raise

    def _start(self, popen) -> None:
        client, peer = free_port(self.host), free_port(self.host)
        self.url = f"http://{self.host}:{client}"
        peer_url = f"http://{self.host}:{peer}"
        self._log.truncate(0)
        self._log.seek(0)
        self.proc = popen(
            [ETCD, "--name", "e0", "--data-dir", str(self.data_dir / "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"e0={peer_url}", "--initial-cluster-state", "new"],
            stdout=self._log, stderr=subprocess.STDOUT)

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
