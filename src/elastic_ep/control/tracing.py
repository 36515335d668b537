"""Request and epoch traces (`--otlp-traces-endpoint`), sampled at the end of each request.

Every request is recorded cheaply while it runs (a few timestamps, the ranks it ran on, its
migrations, which rank its steps waited for); at its end it is emitted if it was head-sampled
(`--trace-sample-ratio`) or if it is abnormal: it crossed a fault or an eviction (a recovery
pause), or its latency reached the recent p99. Full tracing is too much at thousands of ranks and
thousands of requests a second, and a head decision alone would drop exactly the traces an
operator looks for, so the decision waits for the end.

A request's trace is a span `llm_request` (vLLM's name and `gen_ai.*` attributes) with children
`queue` (arrival to its first planned chunk), `prefill` (to its first token), `decode` (to its
end), one `recovery_pause` per recovery it lived through, one `migration` per move of its KV or
re-prefill elsewhere. `decode` names the rank its steps waited for most (`elastic_ep.waited_on_rank`:
the rank with the longest own time in those steps), which is where a slow card shows. Each epoch
change is an `epoch_change` span of its own, always emitted.

This module imports no OpenTelemetry: the controller has no `RequestTraces` at all without an
endpoint, and control/otel.py (the only importer of the SDK) is loaded only with one (`Controller`).
Control thread only.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from elastic_ep.errors import ElasticEPError

P99_WINDOW = 1000  # recent request latencies the p99 is taken over
P99_MIN_SAMPLES = 100  # fewer than this: no p99 yet (the first requests are not all "slow")
P99_REFRESH = 50  # finishes between two computations of the p99
MAX_RECOVERIES = 256  # recent recovery pauses kept to match against requests still running


@dataclass
class Pause:
    """A recovery: from the fault's detection to the first step served after it (wall ns)."""

    start_ns: int
    cause: str
    culprits: list[int]
    evicted: bool
    end_ns: int | None = None
    epoch: int | None = None


@dataclass
class Migration:
    start_ns: int
    end_ns: int
    kind: str  # "kv" (its cache copied), "reprefill" (recomputed on the new rank), "fault" (its rank was lost)
    src_rank: int | None
    dst_rank: int | None


@dataclass
class RequestTrace:
    """What is recorded of one request while it runs; times are wall-clock ns."""

    seq_id: int
    request_id: str
    prompt_tokens: int
    arrival_ns: int
    head_sampled: bool
    scheduled_ns: int = 0
    first_token_ns: int = 0
    end_ns: int = 0
    output_tokens: int = 0
    finish_reason: str = ""
    ranks: list[int] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)
    waited_on: Counter = field(default_factory=Counter)  # rank -> steps of this request it was the slowest in
    pauses: list[Pause] = field(default_factory=list)
    sampled_by: str = ""  # head, fault, eviction, p99

    def attributes(self, model_name: str) -> dict[str, Any]:
        """vLLM's request span attributes (gen_ai.*), then ours."""
        end = self.end_ns
        attrs: dict[str, Any] = {
            "gen_ai.request.id": self.request_id, "gen_ai.response.model": model_name,
            "gen_ai.usage.prompt_tokens": self.prompt_tokens, "gen_ai.usage.completion_tokens": self.output_tokens,
            "gen_ai.latency.e2e": (end - self.arrival_ns) / 1e9,
            "elastic_ep.finish_reason": self.finish_reason, "elastic_ep.sampled_by": self.sampled_by,
            "elastic_ep.ranks": list(self.ranks), "elastic_ep.recoveries": len(self.pauses),
            "elastic_ep.migrations": len(self.migrations),
        }
        if self.scheduled_ns:
            attrs["gen_ai.latency.time_in_queue"] = (self.scheduled_ns - self.arrival_ns) / 1e9
        if self.first_token_ns:
            attrs["gen_ai.latency.time_to_first_token"] = (self.first_token_ns - self.arrival_ns) / 1e9
        return attrs


@dataclass(frozen=True)
class EpochSpan:
    epoch: int
    reason: str
    members: list[int]
    start_ns: int
    end_ns: int
    fields: Mapping[str, Any]


class TraceSink(Protocol):
    """Where finished traces go (control/otel.py: OpenTelemetry; tests: a list)."""

    def request(self, trace: RequestTrace) -> None: ...

    def epoch(self, span: EpochSpan) -> None: ...

    def shutdown(self) -> None: ...


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() instant as wall-clock ns (spans are in wall time)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestTraces:
    """sink: where sampled traces go; sample_ratio: the share of requests head-sampled (0..1),
    whatever the share, every request that crossed a recovery or reached the p99 is emitted."""

    def __init__(self, sink: TraceSink, sample_ratio: float, rng: random.Random | None = None):
        if not 0.0 <= sample_ratio <= 1.0:
            raise ElasticEPError(f"--trace-sample-ratio must be between 0 and 1 (the share of requests traced), "
                                 f"got {sample_ratio}")
        self.sink = sink
        self.sample_ratio = sample_ratio
        self._rng = rng or random.Random()
        self.open: dict[int, RequestTrace] = {}
        self._pauses: deque[Pause] = deque(maxlen=MAX_RECOVERIES)
        self._latencies_s: deque[float] = deque(maxlen=P99_WINDOW)
        self._since_p99 = 0
        self.p99_s: float | None = None
        self.emitted = Counter()  # sampled_by -> requests emitted; "dropped" for those not sampled

    def arrived(self, seq_id: int, request_id: str, prompt_tokens: int) -> None:
        self.open[seq_id] = RequestTrace(seq_id, request_id, prompt_tokens, time.time_ns(),
                                         self._rng.random() < self.sample_ratio)

    def step(self, seq_ids: Mapping[int, Iterable[int]], started_ns: int, ended_ns: int, slowest_rank: int | None,
             outputs: Iterable[tuple[int, int]], migrations: Iterable[tuple[int, str, int | None, int | None]]) -> None:
        """A completed step: `seq_ids` rank -> the sequences it ran, the rank with the longest own time,
        (seq_id, tokens generated so far) of the sequences that sampled a token, and (seq_id, kind,
        src, dst) of the moves it made."""
        for rank, planned in seq_ids.items():
            for seq_id in planned:
                t = self.open.get(seq_id)
                if t is None:
                    continue
                if not t.scheduled_ns:
                    t.scheduled_ns = started_ns
                if not t.ranks or t.ranks[-1] != rank:
                    t.ranks.append(rank)
                if slowest_rank is not None:
                    t.waited_on[slowest_rank] += 1
        for seq_id, generated in outputs:
            t = self.open.get(seq_id)
            if t is not None:
                t.output_tokens = generated
                t.first_token_ns = t.first_token_ns or ended_ns
        for seq_id, kind, src, dst in migrations:
            self.moved(seq_id, kind, src, dst, started_ns, ended_ns)

    def moved(self, seq_id: int, kind: str, src: int | None, dst: int | None, start_ns: int,
              end_ns: int | None = None) -> None:
        t = self.open.get(seq_id)
        if t is not None:
            t.migrations.append(Migration(start_ns, end_ns or start_ns, kind, src, dst))

    def recovery_began(self, detected_at_s: float, cause: str, culprits: Iterable[int], evicted: bool) -> None:
        """A recovery starts (`detected_at_s`: monotonic time the fault was detected)."""
        self._pauses.append(Pause(wall_ns(detected_at_s), cause, sorted(culprits), evicted))

    def recovery_ended(self, epoch: int) -> None:
        """The first step after the recovery (or recoveries in a row) completed."""
        now = time.time_ns()
        for p in self._pauses:
            if p.end_ns is None:
                p.end_ns, p.epoch = now, epoch

    def finished(self, seq_id: int, finish_reason: str) -> None:
        """The request ended: emit it if sampled, forget it either way."""
        t = self.open.pop(seq_id, None)
        if t is None:
            return
        t.end_ns, t.finish_reason = time.time_ns(), finish_reason
        t.pauses = [p for p in self._pauses if p.start_ns <= t.end_ns and (p.end_ns or t.end_ns) >= t.arrival_ns]
        latency_s = (t.end_ns - t.arrival_ns) / 1e9
        t.sampled_by = ("eviction" if any(p.evicted for p in t.pauses) else "fault" if t.pauses
                        else "p99" if self.p99_s is not None and latency_s >= self.p99_s
                        else "head" if t.head_sampled else "")
        self._note_latency(latency_s)
        if not t.sampled_by:
            self.emitted["dropped"] += 1
            return
        self.emitted[t.sampled_by] += 1
        self.sink.request(t)

    def epoch_changed(self, epoch: int, reason: str, members: list[int], started_s: float,
                      fields: Mapping[str, Any]) -> None:
        """An epoch formed (`started_s`: monotonic time the change began)."""
        self.sink.epoch(EpochSpan(epoch, reason, list(members), wall_ns(started_s), time.time_ns(), fields))

    def _note_latency(self, latency_s: float) -> None:
        self._latencies_s.append(latency_s)
        self._since_p99 += 1
        if len(self._latencies_s) >= P99_MIN_SAMPLES and (self.p99_s is None or self._since_p99 >= P99_REFRESH):
            self.p99_s = float(np.percentile(np.fromiter(self._latencies_s, float), 99))
            self._since_p99 = 0

