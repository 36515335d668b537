"""The router's backends: the set of `serve` instances (given on the command line, added and
removed at run time, or listed in a file re-read when it changes), what each one's /ready and
/metrics said at the last poll, and the requests this router has open on each.

A backend is eligible for new requests only while its last poll found it ready; a request
that finds it broken (connection lost, a 5xx) marks it not ready at once, until a poll finds
it ready again. A removed backend takes nothing new; requests open on it finish there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.router.placement import DEFAULT_LIVE_S, KeySeen, homes, parse_report
from elastic_ep.router.scoring import Load

logger = logging.getLogger(__name__)

LOAD_METRICS = {
    "elastic_ep_num_requests_running": "running",
    "elastic_ep_num_requests_waiting": "waiting",
    "elastic_ep_kv_cache_usage_perc": "kv_usage",
}
PREFIX_METRICS = {
    "elastic_ep_prefix_cache_queries": "prefix_queries",
    "elastic_ep_prefix_cache_hits": "prefix_hits",
}
"""Prefix cache counters (prompt tokens looked up, tokens found cached); prometheus-client
reports a counter `X_total` as family `X`."""


@dataclass
class BackendMetrics:
    """What one /metrics answer said; a metric the instance does not export reads as 0
    (`present` lists the ones it does)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    present: frozenset[str] = frozenset()


def parse_metrics(text: str) -> BackendMetrics:
    """The load and prefix-cache figures of a Prometheus text exposition (summed over labels)."""
    wanted = {**LOAD_METRICS, **PREFIX_METRICS}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = wanted.get(family.name) or wanted.get(family.name.removesuffix("_total"))
        if name is None:
            continue
        samples = [s.value for s in family.samples if not s.name.endswith("_created")]
        values[name] = values.get(name, 0.0) + sum(samples)
    return BackendMetrics(**values, present=frozenset(values))


@dataclass
class Backend:
    url: str
    source: str
    """"cli", "api" or "file": a re-read of the file adds and removes only its own."""
    ready: bool = False
    reason: str = "not polled yet"
    metrics: BackendMetrics = field(default_factory=BackendMetrics)
    prefix_keys: dict[bytes, KeySeen] = field(default_factory=dict)
    """Its GET /prefix_keys at the last poll (router/placement.py); empty when it has none."""
    open_here: int = 0
    sent: int = 0
    """Requests (and moved streams) this router sent here."""
    removed: bool = False

    def load(self) -> Load:
        m = self.metrics
        return Load(m.running, m.waiting, m.kv_usage, self.open_here)

    def mark_broken(self, reason: str) -> None:
        """Seen failing by a request: not ready until a poll finds it ready again."""
        if self.ready:
            logger.warning("backend %s failed (%s): no new requests until it is ready again", self.url, reason)
        self.ready, self.reason = False, reason

    def view(self) -> dict:
        m = self.metrics
        return {"url": self.url, "source": self.source, "ready": self.ready, "reason": self.reason,
                "open_here": self.open_here, "sent": self.sent, "running": m.running, "waiting": m.waiting,
                "kv_usage": m.kv_usage, "prefix_queries": m.prefix_queries, "prefix_hits": m.prefix_hits,
                "prefix_keys": len(self.prefix_keys)}


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"backend {url!r} is not an http:// or https:// URL")
    return url


class BackendPool:
    """The backends and their poll loop.

    poll_interval_s: how often every backend's /ready and /metrics are read (and the backends
    file checked for a change); poll_timeout_s: a backend that does not answer a poll within
    this long is not ready. `on_change` is called after every poll and every change of the set
    (the request queue wakes on it). After every poll `homes` is each key's home and `live` the
    live keys at home per backend, from the ready backends' reports (router/placement.py, with
    `live_s`), and `polls` counts the polls.
    """

    def __init__(self, client: httpx.AsyncClient, *, poll_interval_s: float = 0.5, poll_timeout_s: float = 2.0,
                 backends_file: str | None = None, on_change: Callable[[], None] = lambda: None,
                 live_s: float = DEFAULT_LIVE_S):
        self.client = client
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.backends_file = Path(backends_file) if backends_file else None
        self.on_change = on_change
        self.backends: dict[str, Backend] = {}
        self._file_mtime_ns: int | None = None
        self._task: asyncio.Task | None = None
        self.live_s = live_s
        self.homes: dict[bytes, str] = {}
        self.live: dict[str, int] = {}
        self.polls = 0

    def add(self, url: str, source: str) -> Backend:
        url = normalize_url(url)
        backend = self.backends.get(url)
        if backend is None:
            backend = self.backends[url] = Backend(url, source)
            logger.info("backend %s added (%s)", url, source)
        self.on_change()
        return backend

    def remove(self, url: str) -> Backend | None:
        backend = self.backends.pop(normalize_url(url), None)
        if backend is not None:
            backend.removed = True
            logger.info("backend %s removed", backend.url)
        self.on_change()
        return backend

    def ready(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.ready]

    def read_file(self) -> None:
        """Make the file's backends those listed in it (one URL a line, # comments), if it changed."""
        if self.backends_file is None:
            return
        try:
            mtime_ns = os.stat(self.backends_file).st_mtime_ns
        except FileNotFoundError:
            mtime_ns = -1
        if mtime_ns == self._file_mtime_ns:
            return
        self._file_mtime_ns = mtime_ns
        lines = self.backends_file.read_text().splitlines() if mtime_ns >= 0 else []
        listed = set()
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                listed.add(normalize_url(line))
            except ValueError as e:
                logger.error("%s: %s (line skipped)", self.backends_file, e)
        for url in [u for u, b in self.backends.items() if b.source == "file" and u not in listed]:
            self.remove(url)
        for url in sorted(listed - set(self.backends)):
            self.add(url, "file")

    async def poll_once(self) -> None:
        self.read_file()
        await asyncio.gather(*(self._poll(b) for b in list(self.backends.values())))
        self.homes, self.live = homes({b.url: b.prefix_keys for b in self.ready()}, self.live_s)
        self.polls += 1
        self.on_change()

    async def _poll(self, backend: Backend) -> None:
        try:
            ready, metrics, keys = await asyncio.gather(
                self.client.get(f"{backend.url}/ready", timeout=self.poll_timeout_s),
                self.client.get(f"{backend.url}/metrics", timeout=self.poll_timeout_s),
                self.client.get(f"{backend.url}/prefix_keys", timeout=self.poll_timeout_s),
            )
        except httpx.HTTPError as e:
            backend.ready, backend.reason = False, f"unreachable: {type(e).__name__}: {e}"
            backend.prefix_keys = {}
            return
        try:
            backend.prefix_keys = parse_report(keys.json()) if keys.status_code == 200 else {}
        except ValueError:
            backend.prefix_keys = {}
        if metrics.status_code == 200:
            try:
                backend.metrics = parse_metrics(metrics.text)
            except ValueError as e:
                logger.warning("backend %s: unreadable /metrics (%s)", backend.url, e)
        backend.ready = ready.status_code == 200
        backend.reason = "" if backend.ready else _reason(ready)

    async def _loop(self) -> None:
        while True:
            started_s = time.monotonic()
            try:
                await self.poll_once()
            except Exception:
                logger.exception("polling the backends failed; trying again")
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started_s)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _reason(response: httpx.Response) -> str:
    try:
        return f"/ready {response.status_code}: {response.json().get('reason', '')}"
    except ValueError:
        return f"/ready {response.status_code}"
