"""Real `elastic-ep serve` processes for end-to-end tests, and reference outputs from
single-process `elastic-ep generate`.

Every server listens on a free port, is stopped with SIGTERM (SIGKILL after a grace period)
and takes its workers with it (they die with their parent); the tests never leave orphans.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import httpx
import openai
import pytest

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time",
    "1 2 3 4 5",
    "elastic expert parallel",
    "hello world",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `elastic-ep serve` process. `url` is its HTTP base; `client` an OpenAI client."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_ep.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)
        self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.http.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready within {timeout_s}s:\n{self.log()[-3000:]}")

    def wait_for(self, predicate, timeout_s: float = 30.0, what: str = "condition") -> dict:
        """Poll /cluster until predicate(cluster) holds; returns that cluster JSON."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cluster = self.cluster()
            if predicate(cluster):
                return cluster
            time.sleep(0.1)
        raise TimeoutError(f"{what} not reached within {timeout_s}s: {json.dumps(self.cluster())[:3000]}")

    def cluster(self) -> dict:
        return self.http.get("/cluster").json()

    def pids(self) -> dict[int, int]:
        return {r["rank_id"]: r["pid"] for r in self.cluster()["ranks"] if r["state"] == "serving"}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def complete(self, prompt: str, max_tokens: int, **kwargs) -> str:
        out = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens, **kwargs)
        return out.choices[0].text

    def stream(self, prompt: str, max_tokens: int, **kwargs) -> tuple[str, list[float]]:
        """Streamed completion text and the arrival time of every chunk."""
        times, parts = [], []
        for chunk in self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, stream=True, **kwargs
        ):
            times.append(time.monotonic())
            parts.append(chunk.choices[0].text if chunk.choices else "")
        return "".join(parts), times

    @property
    def model(self) -> str:
        return self.http.get("/v1/models").json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()
        self._log.close()


@cache
def reference(model: str, prompts: tuple[str, ...], max_tokens: int, temperature: float = 0.0,
              seed: int | None = None) -> tuple[str, ...]:
    """Completion texts of single-process `elastic-ep generate`."""
    cmd = [sys.executable, "-m", "elastic_ep.cli", "generate", "--json", "--model", model,
           "--max-tokens", str(max_tokens), "--temperature", str(temperature)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    for p in prompts:
        cmd += ["--prompt", p]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    return tuple(json.loads(line)["text"] for line in out.splitlines() if line.strip())


def concurrently(fn, items):
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    """Start servers for one test module; all are stopped when the module ends."""
    started: list[Server] = []

    def start(*args: str) -> Server:
        log = tmp_path_factory.mktemp("serve") / "serve.log"
        server = Server(list(args), log)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
