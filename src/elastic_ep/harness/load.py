"""Streaming load on a server, for end-to-end tests, benchmarks and the demo: the real `openai`
client, streamed completions, every chunk's arrival time kept.

- `StreamingLoad`: clients that stream in a loop until stopped (load running beside a fault or
  a scale), every finished text compared with the expected one, every failure kept.
- `streams_with_fault`: N concurrent streams and one action (a fault) once every stream has
  its first chunks, so the action lands mid-stream.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import openai

from elastic_ep.serve.guard import API_KEY_ENV

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time",
    "1 2 3 4 5",
    "elastic expert parallel",
    "hello world",
]


def client_for(url: str, timeout_s: float = 300.0) -> tuple[openai.OpenAI, str]:
    """An OpenAI client on `url` (no retries: a failure is what tests count) and the served model;
    it sends the key of $ELASTIC_EP_API_KEY, as `serve` reads it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=os.environ.get(API_KEY_ENV) or "none", max_retries=0,
                           timeout=timeout_s)
    return client, client.models.list().data[0].id


@dataclass
class Streamed:
    """One streamed completion: its text and the arrival time (monotonic s) of every chunk with a token."""

    text: str
    times: list[float]

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.times)]

    @property
    def largest_gap(self) -> float:
        return max(self.gaps, default=0.0)


def stream(client: openai.OpenAI, model: str, prompt: str, max_tokens: int,
           on_chunk: Callable[[list[float]], None] | None = None, **sampling) -> Streamed:
    """Stream one completion; `on_chunk(times)` after each chunk with the arrival times so far.
    Raises on an error, including a stream that ends with finish_reason "error"."""
    parts, times = [], []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **sampling):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.finish_reason == "error":
            raise RuntimeError(f"stream of {prompt!r} ended with an error")
        times.append(time.monotonic())
        parts.append(choice.text)
        if on_chunk is not None:
            on_chunk(times)
    return Streamed("".join(parts), times)


def streams_with_fault(url: str, inject: Callable[[], object], prompts: list[str], max_tokens: int,
                       after_chunks: int = 1, **sampling) -> list[Streamed]:
    """Stream `prompts` concurrently; call inject() once every stream has `after_chunks` chunks."""
    client, model = client_for(url)
    started = threading.Barrier(len(prompts) + 1)

    def one(prompt: str) -> Streamed:
        return stream(client, model, prompt, max_tokens,
                      lambda times: started.wait(timeout=60) if len(times) == after_chunks else None, **sampling)

    injector = threading.Thread(target=lambda: (started.wait(timeout=60), inject()))
    injector.start()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    injector.join()
    return results


class StreamingLoad:
    """`threads` clients streaming greedy completions of `prompts` in a loop until stopped.

    expected: prompt -> text; a finished text that differs is a failure. `gaps` holds
    (arrival time, gap to the previous chunk of the same stream) of every chunk.
    """

    def __init__(self, url: str, threads: int, max_tokens: int, expected: Mapping[str, str] | None = None,
                 prompts: list[str] = PROMPTS, **sampling):
        self.client, self.model = client_for(url)
        self.max_tokens, self.expected, self.prompts = max_tokens, expected, prompts
        self.sampling = sampling or {"temperature": 0}
        self.done = 0
        self.failures: list[str] = []
        self.gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(threads)]

    def _loop(self, first: int) -> None:
        for k in itertools.count(first):
            if self._stop.is_set():
                return
            prompt = self.prompts[k % len(self.prompts)]
            try:
                result = stream(self.client, self.model, prompt, self.max_tokens, self._record_gap, **self.sampling)
            except Exception as e:  # any failure is what the caller counts
                self.failures.append(f"{prompt!r}: {type(e).__name__}: {e}")
                continue
            if self.expected is not None and result.text != self.expected[prompt]:
                self.failures.append(f"{prompt!r}: {result.text!r} != {self.expected[prompt]!r}")
            self.done += 1

    def _record_gap(self, times: list[float]) -> None:
        if len(times) > 1:
            self.gaps.append((times[-1], times[-1] - times[-2]))

    def wait_done(self, count: int, timeout_s: float = 120.0) -> None:
        """Wait until `count` streams have finished since the load started; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.done < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.done} of {count} streams finished within {timeout_s}s; "
                                   f"failures: {self.failures[:3]}")
            time.sleep(0.05)

    def window_p99_ms(self, t0: float, t1: float) -> float:
        """p99 of the chunk gaps that arrived between t0 and t1 (monotonic s); nan if none."""
        gaps = [g for t, g in list(self.gaps) if t0 <= t <= t1]
        return round(float(np.percentile(gaps, 99)) * 1000, 1) if gaps else float("nan")

    def start(self) -> StreamingLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    def __enter__(self) -> StreamingLoad:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
