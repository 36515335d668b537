"""Real `elastic-ep serve` processes for end-to-end tests, and reference outputs from
single-process `elastic-ep generate`.

Every server listens on a free port, is stopped with SIGTERM (SIGKILL after a grace period)
and takes its workers with it (they die with their parent); the tests never leave orphans.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import openai
import pytest

from elastic_ep.control.server_process import ServerProcess

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time",
    "1 2 3 4 5",
    "elastic expert parallel",
    "hello world",
]


class Server(ServerProcess):
    """A serve process plus an OpenAI client on it."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout_s: float | None = 120.0):
        super().__init__(args, log_path, ready_timeout_s)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

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


class Load:
    """Streams PROMPTS from `threads` clients in a loop until stopped; every finished output
    is compared with the fault-free run."""

    def __init__(self, server, model: str, threads: int = 3, max_tokens: int = 24):
        self.server, self.stop_flag, self.max_tokens = server, threading.Event(), max_tokens
        self.done, self.failures = 0, []
        self.expected = dict(zip(PROMPTS, reference(model, tuple(PROMPTS), max_tokens), strict=True))
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(threads)]

    def _loop(self, i: int) -> None:
        k = i
        while not self.stop_flag.is_set():
            prompt = PROMPTS[k % len(PROMPTS)]
            k += 1
            try:
                text, _ = self.server.stream(prompt, self.max_tokens, temperature=0)
            except Exception as e:  # any failure is what the test counts
                self.failures.append(f"{prompt!r}: {type(e).__name__}: {e}")
                continue
            if text != self.expected[prompt]:
                self.failures.append(f"{prompt!r}: {text!r} != {self.expected[prompt]!r}")
            self.done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(120)


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
