"""Real `elastic-ep serve` processes for end-to-end tests, and reference outputs from
single-process `elastic-ep generate` (run in the test process).

Every server listens on a free port, is stopped with SIGTERM (SIGKILL after a grace period)
and takes its workers with it (they die with their parent); the tests never leave orphans.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from elastic_ep.cli import main as cli_main
from elastic_ep.doctor.stacks import worker_process
from elastic_ep.harness.load import PROMPTS, StreamingLoad, stream
from elastic_ep.harness.server_process import ServerProcess


class Server(ServerProcess):
    """A serve process plus an OpenAI client on it."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout_s: float | None = 120.0, **where):
        super().__init__(args, log_path, ready_timeout_s, **where)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def complete(self, prompt: str, max_tokens: int, **kwargs) -> str:
        out = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens, **kwargs)
        return out.choices[0].text

    def stream(self, prompt: str, max_tokens: int, **kwargs) -> str:
        """Streamed completion text."""
        return stream(self.client, self.model, prompt, max_tokens, **kwargs).text

    @property
    def model(self) -> str:
        return self.http.get("/v1/models").json()["data"][0]["id"]


@cache
def reference(model: str, prompts: tuple[str, ...], max_tokens: int, temperature: float = 0.0,
              seed: int | None = None, dtype: str = "auto") -> tuple[str, ...]:
    """Completion texts of single-process `elastic-ep generate`: its command line run in this
    process (the CLI's own code path, one intra-op thread as in the servers' ranks), without a
    Python and torch start for each of the suite's ~20 distinct references."""
    argv = ["generate", "--json", "--model", model, "--max-tokens", str(max_tokens), "--temperature",
            str(temperature), "--dtype", dtype, "--threads", "1"]
    if seed is not None:
        argv += ["--seed", str(seed)]
    for p in prompts:
        argv += ["--prompt", p]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(argv)
    assert code == 0, f"elastic-ep generate exited with {code}"
    return tuple(json.loads(line)["text"] for line in out.getvalue().splitlines() if line.strip())


def concurrently(fn, items):
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


def leave_mid_stream(server: Server, prompt: str, chunks: int = 3) -> None:
    """Stream a long greedy completion, read `chunks` lines of it and close the connection."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": 200, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(chunks):
            next(lines)


def reference_load(server, model: str, threads: int = 3, max_tokens: int = 24) -> StreamingLoad:
    """Greedy streams of PROMPTS in a loop; every finished output is compared with the fault-free run."""
    expected = dict(zip(PROMPTS, reference(model, tuple(PROMPTS), max_tokens), strict=True))
    return StreamingLoad(server.url, threads, max_tokens, expected)


def rank_process(server: Server, rank_id: int, timeout_s: float = 60.0) -> int:
    """The pid of rank `rank_id`'s process as soon as it exists, found among the server's children
    by its command line (a forked worker shows it before it runs: node/zygote.py), polled every
    5 ms: sooner than /cluster, which names it once the agent reports the start."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in psutil.Process(server.proc.pid).children():
            if worker_process(child.pid, rank_id) is not None:
                return child.pid
        time.sleep(0.005)
    raise TimeoutError(f"no process of rank {rank_id} within {timeout_s}s")


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
