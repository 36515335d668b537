"""The request journal of a controller group, replicated to the standbys through etcd (here) or
directly over ZeroMQ (`--ha-journal-via direct`: group/journal_stream.py, the same entries).

The leader's engine is wrapped (`JournaledEngine`): each request is recorded when admitted (its
prompt token ids, sampling parameters, seed and any resumed output) and each event it yields adds
its new tokens. Nothing touches the control loop: the HTTP thread appends to an in-memory buffer
(`JournalWriter.add`, a lock and a list append), and the writer's thread ships what gathered every
`flush_s` as one etcd put of one batch, under `journal/<seq>` (seq zero-padded, so keys sort by
seq), written only while this controller's term holds the leader key (a txn: etcd refuses the
batch of a deposed leader). Every `snapshot_every` batches it writes the state of every unfinished request as
`journal-snapshot` (at that seq) and deletes the batches it covers, so the journal holds only what
a new leader needs. A standby's `JournalReader` applies the snapshot and then every newer batch
(every `interval_s`), and says how far it got in its seat (`journal_seq`): GET /cluster shows each
standby's lag in batches. The journal survives the leader (no lease: a new leader takes it over and
goes on numbering after the last batch, and runs its unfinished requests on: group/adopted.py).

A request a leader ran on from the journal and finished with nobody attached (its client gone
with the last leader) leaves the journal as `Kept`: its tokens and finish reason stay in the journal
(`kept`, carried by every snapshot) for `KEEP_S` after it finished, at most `MAX_KEPT` of them (the
oldest go first), so a client that re-attaches after a second takeover still gets it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import msgspec

from elastic_ep.control.api import Engine, GenerationRequest, RequestOutput, ResumeConflict
from elastic_ep.model.sampling import SamplingParams

from .store import EtcdUnavailable, GroupStore

if TYPE_CHECKING:
    from .adopted import AdoptedRequests

logger = logging.getLogger(__name__)


class Admitted(msgspec.Struct, frozen=True, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int]  # resumed output it started with


class Delivered(msgspec.Struct, frozen=True, tag=True, array_like=True):
    request_id: str
    token_ids: list[int]
    finished: bool


class Kept(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The request finished (its last tokens `token_ids`) with nobody attached, at `finished_at_s`
    (the leader's wall clock): kept for KEEP_S."""

    request_id: str
    token_ids: list[int]
    finish_reason: str
    finished_at_s: float


Entry = Admitted | Delivered | Kept

KEEP_S = 300.0  # as long as a leader keeps such a request itself (group/adopted.py keep_s, the orphan window)
MAX_KEPT = 1000  # every snapshot carries them: some 1000 x (prompt + output) tokens at most


class Journaled(msgspec.Struct):
    """A request as the journal has it: what a new leader needs to resume it from its tokens."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # of a kept one
    finished_at_s: float = 0.0  # of a kept one (wall clock)

    def resumed(self) -> GenerationRequest:
        """The request that goes on from the journaled tokens (as `resume_output_token_ids` does)."""
        return GenerationRequest(self.request_id, list(self.prompt_token_ids), self.params, self.seed,
                                 tuple(self.output_token_ids))


class Snapshot(msgspec.Struct):
    seq: int
    requests: list[Journaled]
    kept: list[Journaled] = msgspec.field(default_factory=list)


_batch = msgspec.msgpack.Decoder(list[Entry])
_snapshot = msgspec.msgpack.Decoder(Snapshot)


def apply(requests: dict[str, Journaled], kept: dict[str, Journaled], entries: list[Entry],
          max_kept: int = MAX_KEPT) -> None:
    """Entries in order onto `requests` (request id -> state of the unfinished ones) and `kept` (the
    finished ones kept, oldest first, at most `max_kept`); other finished requests leave both."""
    for e in entries:
        if isinstance(e, Admitted):
            kept.pop(e.request_id, None)
            requests[e.request_id] = Journaled(e.request_id, e.prompt_token_ids, e.params, e.seed,
                                               list(e.output_token_ids))
            continue
        r = requests.get(e.request_id)
        if r is None:
            continue
        r.output_token_ids.extend(e.token_ids)
        if isinstance(e, Kept):
            del requests[e.request_id]
            r.finished, r.finish_reason, r.finished_at_s = True, e.finish_reason, e.finished_at_s
            kept[e.request_id] = r
            while len(kept) > max_kept:
                del kept[next(iter(kept))]
        elif e.finished:
            del requests[e.request_id]


def unexpired(kept: dict[str, Journaled], now_s: float, keep_s: float = KEEP_S) -> dict[str, Journaled]:
    """The kept requests that finished within `keep_s` of `now_s` (wall clock)."""
    return {i: r for i, r in kept.items() if now_s - r.finished_at_s <= keep_s}


MAX_BATCH_BYTES = 1 << 20  # etcd refuses a request over 1.5 MiB (--max-request-bytes)


def bounded_batches(entries: list[Entry], max_bytes: int = MAX_BATCH_BYTES) -> list[tuple[list[Entry], bytes]]:
    """`entries` in order as batches of at most `max_bytes` encoded (halved until they fit; an entry
    alone over it, a prompt of some 100,000 tokens, is its own batch)."""
    if not entries:
        return []
    body = msgspec.msgpack.encode(entries)
    if len(body) <= max_bytes or len(entries) == 1:
        return [(entries, body)]
    half = len(entries) // 2
    return bounded_batches(entries[:half], max_bytes) + bounded_batches(entries[half:], max_bytes)


def _seq_key(store: GroupStore, seq: int) -> str:
    return f"{store.prefix}journal/{seq:016d}"


class JournalCopy(ABC):
    """The journal as a standby holds it: `requests` (unfinished, with their tokens) and `kept` (finished
    ones kept) up to batch `applied`."""

    def __init__(self) -> None:
        self.requests: dict[str, Journaled] = {}
        self.kept: dict[str, Journaled] = {}
        self.applied = 0

    def load(self, snapshot: Snapshot) -> None:
        self.requests = {r.request_id: r for r in snapshot.requests}
        self.kept = {r.request_id: r for r in snapshot.kept}
        self.applied = snapshot.seq

    def apply_batch(self, seq: int, body: bytes) -> None:
        """Batch `seq` (the next one), its msgpack `body` decoded (raises msgspec.ValidationError)."""
        apply(self.requests, self.kept, _batch.decode(body))
        self.applied = seq

    @abstractmethod
    def run(self, stop: threading.Event, on_applied: Callable[[int], None]) -> None:
        """Keep the copy up to date until `stop`; `on_applied(seq)` when it moved on."""


class JournalReader(JournalCopy):
    """A standby's copy of the journal through etcd."""

    def __init__(self, store: GroupStore):
        super().__init__()
        self.store = store

    def catch_up(self) -> None:
        """Apply what etcd holds past `applied` (the snapshot first when the batches it needs are gone)."""
        held = self.store.get_prefix(self.store.prefix + "journal")
        snap = held.get(self.store.prefix + "journal-snapshot")
        if snap is not None:
            snapshot = _snapshot.decode(snap.value)
            if snapshot.seq > self.applied:
                self.load(snapshot)
        prefix = self.store.prefix + "journal/"
        for key in sorted(k for k in held if k.startswith(prefix)):
            seq = int(key[len(prefix):])
            if seq == self.applied + 1:
                self.apply_batch(seq, held[key].value)

    def run(self, stop: threading.Event, on_applied: Callable[[int], None], interval_s: float = 0.2) -> None:
        """Catch up every `interval_s` until `stop`; `on_applied(seq)` after each."""
        while not stop.wait(interval_s):
            try:
                self.catch_up()
            except EtcdUnavailable:
                continue
            on_applied(self.applied)


class Deposed(Exception):
    """etcd refused a journal batch: another controller leads now."""


class LeaderJournal(ABC):
    """The leader's side, in `term`, whichever way it ships: `add` from any thread; `run` ships
    batches until `stop`. Starts numbering after `start_seq` (the last batch this controller applied
    as a standby), over the requests it found unfinished and kept."""

    def __init__(self, term: int, start_seq: int = 0, requests: dict[str, Journaled] | None = None,
                 kept: dict[str, Journaled] | None = None):
        self.term, self.seq = term, start_seq
        # the last leader's unfinished requests, which this one runs on (group/adopted.py): their
        # entries go on from here, and a snapshot carries them
        self.requests = dict(requests or {})
        self.kept = dict(kept or {})
        self._lock = threading.Lock()
        self._buffer: list[Entry] = []
        self.shipped_entries = 0

    def add(self, entry: Entry) -> None:
        with self._lock:
            self._buffer.append(entry)

    @abstractmethod
    def _ship(self, seq: int, body: bytes) -> None:
        """Batch `seq` to the standbys (raises EtcdUnavailable: not shipped; Deposed)."""

    def _shipped(self) -> None:  # noqa: B027 - a hook: only the etcd path does something here
        """After each batch shipped (the etcd path's snapshot)."""

    def _wait(self, stop: threading.Event, seconds: float) -> bool:
        """Until the next flush (the direct path answers standbys meanwhile); whether to stop."""
        return stop.wait(seconds)

    def snapshot(self) -> bytes:
        """The journal as of batch `seq` (the msgpack of a Snapshot); expired kept requests dropped."""
        self.kept = unexpired(self.kept, time.time())
        return msgspec.msgpack.encode(Snapshot(self.seq, list(self.requests.values()), list(self.kept.values())))

    def flush(self) -> bool:
        """Ship what gathered, as one batch or, past MAX_BATCH_BYTES (etcd refuses a request over
        1.5 MiB), as several in order; False when there was nothing or none was shipped (what was not
        stays buffered, in order, for the next flush)."""
        with self._lock:
            entries, self._buffer = self._buffer, []
        batches = bounded_batches(entries)
        for i, (batch, body) in enumerate(batches):
            try:
                self._ship(self.seq + 1, body)
            except EtcdUnavailable as e:
                rest = [entry for left, _ in batches[i:] for entry in left]
                logger.warning("journal: %s; %d entries wait for the next flush", e, len(rest))
                with self._lock:
                    self._buffer[:0] = rest
                return i > 0
            self.seq += 1
            self.shipped_entries += len(batch)
            apply(self.requests, self.kept, batch)
            self._shipped()
        return bool(batches)

    def run(self, stop: threading.Event, flush_s: float, on_shipped: Callable[[int], None],
            on_deposed: Callable[[str], None]) -> None:
        while not self._wait(stop, flush_s):
            try:
                if self.flush():
                    on_shipped(self.seq)
            except EtcdUnavailable as e:
                logger.warning("journal: %s", e)
            except Deposed as e:
                on_deposed(str(e))
                return


class JournalWriter(LeaderJournal):
    """The leader's side through etcd: each batch one put under `journal/<seq>`, fenced by the term;
    every `snapshot_every` batches a snapshot replaces them."""

    def __init__(self, store: GroupStore, term: int, start_seq: int = 0,
                 requests: dict[str, Journaled] | None = None, snapshot_every: int = 100,
                 kept: dict[str, Journaled] | None = None):
        super().__init__(term, start_seq, requests, kept)
        self.store, self.snapshot_every = store, snapshot_every

    def _ship(self, seq: int, body: bytes) -> None:
        if not self.store.put_as_leader(_seq_key(self.store, seq), body, self.term):
            raise Deposed(f"etcd refused journal batch {seq}: term {self.term} no longer leads")

    def _shipped(self) -> None:
        if self.seq % self.snapshot_every:
            return
        if not self.store.put_as_leader(self.store.prefix + "journal-snapshot", self.snapshot(), self.term):
            raise Deposed(f"etcd refused the journal snapshot: term {self.term} no longer leads")
        self.store.delete_range(_seq_key(self.store, 0), _seq_key(self.store, self.seq + 1))


class JournaledEngine:
    """`engine` whose requests and their tokens go to `writer` (set once this controller leads, before
    any request reaches it); every other call is the engine's. A re-attach (`request.reattach`) to a
    request `adopted` holds (the last leader's, run on here: group/adopted.py) follows that request;
    one that names a request running here for another client is refused (ResumeConflict), so one id
    is never two requests in the journal. A scale, drain, uncordon or rolling restart the engine
    accepted is answered once `record()` (the cluster record's write: group/record.py, set as
    `writer` is) returned, run in a thread so that the event loop does not wait on etcd: a
    takeover right after the answer finds the operation in the record. The answer waits for that
    one etcd write, at most the store's timeout; an etcd that could not be reached does not turn
    an accepted operation into an error (it runs; the periodic write records it once etcd answers)."""

    def __init__(self, engine: Engine, writer: LeaderJournal | None = None, adopted: AdoptedRequests | None = None,
                 record: Callable[[], bool] | None = None):
        self._engine, self.writer, self.adopted, self.record = engine, writer, adopted, record
        self.info = engine.info
        self._running: Counter[str] = Counter()  # ids in generate (two clients may name one: X-Request-Id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        writer = self.writer
        assert writer is not None, "a request reached a controller that does not lead"
        if request.reattach:
            followed = await self.adopted.attach(request) if self.adopted is not None else None
            if followed is not None:
                async with aclosing(followed) as events:
                    async for out in events:
                        yield out
                return
            if request.request_id in self._running:
                raise ResumeConflict(f"request {request.request_id} runs on this controller for another client; "
                                     "it goes on there")
        if self.adopted is not None and (request.reattach or request.resumed_output_token_ids) \
                and request.request_id not in self.adopted.held:
            self.adopted.resumed.labels(by="client").inc()
            logger.info("request %s: a client's resume after %d tokens runs anew", request.request_id,
                        len(request.resumed_output_token_ids))
        self._running[request.request_id] += 1
        writer.add(Admitted(request.request_id, list(request.prompt_token_ids), request.params, request.seed,
                            list(request.resumed_output_token_ids)))
        finished = False
        try:
            async for out in self._engine.generate(request):
                finished = out.finished
                if finished and self._unattended(request.request_id, out.finish_reason):
                    writer.add(Kept(request.request_id, list(out.new_token_ids), out.finish_reason, time.time()))
                else:
                    writer.add(Delivered(request.request_id, list(out.new_token_ids), out.finished))
                yield out
        finally:
            self._running[request.request_id] -= 1
            if not self._running[request.request_id]:
                del self._running[request.request_id]
            if not finished:
                writer.add(Delivered(request.request_id, [], True))

    def _unattended(self, request_id: str, finish_reason: str | None) -> bool:
        """Whether a request that ends now with `finish_reason` is one of the last leader's that this
        one ran on with no client attached, to be kept in the journal (group/adopted.py keeps it in
        memory too). Not one that ended in an error, nor one that asked for logprobs (the journal
        holds none: its re-attach runs anew)."""
        held = self.adopted.held.get(request_id) if self.adopted is not None else None
        return (held is not None and not held.attached and finish_reason in ("stop", "length")
                and held.request.params.logprobs is None)

    def forget(self, request_id: str) -> None:
        """The journal's end of a request that ended without reaching `generate` (one of the last
        leader's, aborted before it began here)."""
        if request_id not in self._running and self.writer is not None:
            self.writer.add(Delivered(request_id, [], True))

    async def _recorded(self, accepted: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        answer = await accepted  # a refusal raises here: nothing changed, nothing to record
        if self.record is not None and not await asyncio.to_thread(self.record):
            logger.warning("the cluster record could not be written at once after an accepted operation (%s); "
                           "the periodic write retries", answer)
        return answer

    async def scale(self, new_ep_size: int, ranks: list[int] | None = None) -> dict[str, Any]:
        return await self._recorded(self._engine.scale(new_ep_size, ranks))

    async def drain(self, ranks: list[int] | None = None, node: str | None = None) -> dict[str, Any]:
        return await self._recorded(self._engine.drain(ranks, node))

    async def uncordon(self, node: str) -> dict[str, Any]:
        return await self._recorded(self._engine.uncordon(node))

    async def rolling_restart(self, options: dict[str, Any]) -> dict[str, Any]:
        return await self._recorded(self._engine.rolling_restart(options))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
