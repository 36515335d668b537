"""The streams' delivery (control/serving/streams.py): a step's tokens reach each event loop in one
hand-over, every stream's outputs in the order of the steps, a finished stream gets nothing more,
a closed loop aborts the requests it held, and an error end reaches its stream at once. The
requests of API server processes reach each server in one send per step; a server that cannot
take them has its requests aborted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from elastic_ep.control.api import GenerationRequest, RequestOutput
from elastic_ep.control.serving.scheduler import Scheduler, Sequence
from elastic_ep.control.serving.streams import RemoteStream, Stream, Streams
from elastic_ep.control.tracing import RequestTraces
from elastic_ep.model.sampling import SamplingParams, TokenLogprobs
from elastic_ep.wire.api_server import StreamOutputs


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts what other threads hand it."""

    handed = 0

    def call_soon_threadsafe(self, callback, *args, context=None):
        self.handed += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


@contextmanager
def running_loop() -> Iterator[CountingLoop]:
    loop = CountingLoop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


class Sink:
    def __init__(self):
        self.requests = []

    def request(self, trace) -> None:
        self.requests.append(trace)

    def epoch(self, span) -> None: ...

    def shutdown(self) -> None: ...


def streams_of(seq_ids: list[int], loops: list[asyncio.AbstractEventLoop]) -> tuple[Streams, Scheduler, Sink]:
    """Streams over a scheduler holding `seq_ids`, each on the loop of its position (round robin),
    every request traced."""
    scheduler = Scheduler(max_num_seqs=16, max_num_batched_tokens=256)
    scheduler.set_ranks([0])
    sink = Sink()
    traces = RequestTraces(sink, 1.0)
    streams = Streams(scheduler, traces)
    for k, seq_id in enumerate(seq_ids):
        scheduler.add(Sequence(seq_id, GenerationRequest(f"r{seq_id}", [1, 2, 3], SamplingParams(max_tokens=8), 0),
                               64, (0,)))
        traces.arrived(seq_id, f"r{seq_id}", 3)
        streams.add(seq_id, Stream(f"r{seq_id}", loops[k % len(loops)], asyncio.Queue()))
    return streams, scheduler, sink


def queue_of(streams: Streams, seq_id: int) -> asyncio.Queue:
    return streams._streams[seq_id].queue


def drained(loop: asyncio.AbstractEventLoop, queues: dict[int, asyncio.Queue]) -> dict[int, list[RequestOutput]]:
    """What each queue holds once its loop ran everything handed to it so far."""
    async def take() -> dict[int, list[RequestOutput]]:
        return {seq_id: [q.get_nowait() for _ in range(q.qsize())] for seq_id, q in queues.items()}
    return asyncio.run_coroutine_threadsafe(take(), loop).result(5)


def test_each_loop_gets_one_hand_over_per_step_and_every_stream_its_tokens_in_order():
    with running_loop() as a, running_loop() as b:
        seq_ids = list(range(10))
        streams, _, sink = streams_of(seq_ids, [a, b])
        queues = {s: queue_of(streams, s) for s in seq_ids}
        for step in range(5):
            streams.deliver_step((s, [100 * step + s], "length" if step == 4 and s == 3 else None, None)
                                 for s in seq_ids)
        assert a.handed == b.handed == 5  # not 25 each: one per step, whatever the streams
        got = {**drained(a, {s: q for s, q in queues.items() if s % 2 == 0}),
               **drained(b, {s: q for s, q in queues.items() if s % 2 == 1})}
    for s in seq_ids:
        assert [o.new_token_ids for o in got[s]] == [[100 * step + s] for step in range(5)]
        assert all(o.request_id == f"r{s}" for o in got[s])
    assert got[3][-1] == RequestOutput("r3", [403], True, "length")
    assert not any(o.finished for s in seq_ids if s != 3 for o in got[s])
    assert [(t.seq_id, t.finish_reason) for t in sink.requests] == [(3, "length")]


def test_a_finished_stream_gets_nothing_more():
    with running_loop() as loop:
        streams, _, _ = streams_of([1, 2], [loop])
        queues = {s: queue_of(streams, s) for s in (1, 2)}
        streams.deliver_step([(1, [7], "stop", None), (2, [8], None, None)])
        streams.deliver_step([(1, [9], None, None), (2, [10], None, None)])
        got = drained(loop, queues)
    assert got[1] == [RequestOutput("r1", [7], True, "stop")]
    assert [o.new_token_ids for o in got[2]] == [[8], [10]]


def test_a_closed_loop_aborts_its_requests_and_the_other_loops_streams_go_on():
    with running_loop() as live:
        gone = asyncio.new_event_loop()
        gone.close()
        streams, scheduler, sink = streams_of([1, 2, 3], [gone, live])  # 1 and 3 on the closed loop
        queue = queue_of(streams, 2)
        streams.deliver_step((s, [5], None, None) for s in (1, 2, 3))
        streams.deliver_step((s, [6], None, None) for s in (1, 2, 3))
        assert live.handed == 2
        got = drained(live, {2: queue})
    assert set(scheduler.by_id) == {2}  # the requests nobody reads any more are aborted, their KV freed
    assert sorted((t.seq_id, t.finish_reason) for t in sink.requests) == [(1, "abort"), (3, "abort")]
    assert [o.new_token_ids for o in got[2]] == [[5], [6]]


def test_an_error_end_reaches_its_stream_at_once_after_what_was_handed_before():
    with running_loop() as loop:
        streams, scheduler, sink = streams_of([1, 2], [loop])
        queues = {s: queue_of(streams, s) for s in (1, 2)}
        streams.deliver_step([(1, [7], None, None), (2, [8], None, None)])
        streams.end_with_error(1, "this request failed on rank 0: boom")
        assert loop.handed == 2  # not waiting for a step: there may be no next one
        streams.deliver_step([(1, [9], None, None), (2, [10], None, None)])
        streams.end_all("server shutting down")
        got = drained(loop, queues)
    assert got[1] == [RequestOutput("r1", [7]),
                      RequestOutput("r1", [], True, "error", "this request failed on rank 0: boom")]
    assert got[2] == [RequestOutput("r2", [8]), RequestOutput("r2", [10]),
                      RequestOutput("r2", [], True, "error", "server shutting down")]
    assert 1 not in scheduler.by_id
    assert [(t.seq_id, t.finish_reason) for t in sink.requests] == [(1, "error"), (2, "error")]


class Servers:
    """API servers that take every send but those of `gone`."""

    def __init__(self, gone: set[int] = frozenset()):
        self.gone = gone
        self.sent: list[tuple[int, StreamOutputs]] = []

    def send(self, server: int, outputs: StreamOutputs) -> bool:
        self.sent.append((server, outputs))
        return server not in self.gone


def test_remote_streams_reach_each_server_in_one_send_per_step_beside_the_loops():
    with running_loop() as loop:
        streams, scheduler, sink = streams_of([0], [loop])  # one in-process stream beside them
        servers = streams.servers = Servers(gone={1})
        for seq_id, server in ((1, 0), (2, 0), (3, 1), (4, 0)):
            scheduler.add(Sequence(seq_id, GenerationRequest(f"r{seq_id}", [1], SamplingParams(max_tokens=8), 0),
                                   64, (0,)))
            traces = streams.traces
            traces.arrived(seq_id, f"r{seq_id}", 1)
            streams.add(seq_id, RemoteStream(f"r{seq_id}", server, 10 + seq_id))
        streams.deliver_step([(0, [5], None, None), (1, [6], None, None), (2, [7], "stop", None),
                              (3, [8], None, None), (4, [9], None, None)])
        streams.deliver_step([(1, [11], None, None), (2, [12], None, None), (3, [13], None, None)])
        lps = [TokenLogprobs(-0.5, ((15, -0.5),))]
        streams.deliver_step([(1, [15], None, lps)])
        streams.end_with_error(4, "rank 2 failed")
        got = drained(loop, {0: queue_of(streams, 0)})
    assert servers.sent[:2] == [(0, StreamOutputs([11, 12, 14], [1, 1, 1], [6, 7, 9], [(1, "stop")])),
                                (1, StreamOutputs([13], [1], [8]))]
    assert servers.sent[2:] == [(0, StreamOutputs([11], [1], [11])),  # 2 ended, 3's server is gone
                                (0, StreamOutputs([11], [1], [15], logprobs=[(0, lps)])),
                                (0, StreamOutputs([14], [0], [], [(0, "error")], [(0, "rank 2 failed")]))]
    assert got[0] == [RequestOutput("r0", [5])]
    # server 1's request aborted, its KV freed (2 ends in its step; 4 ended with its error)
    assert set(scheduler.by_id) == {0, 1, 2}
    assert sorted((t.seq_id, t.finish_reason) for t in sink.requests) == [(2, "stop"), (3, "abort"), (4, "error")]


def test_a_ranks_column_reaches_its_servers_and_loops_as_its_rows_would():
    """Columns (`Scheduler.commit`'s steady rows) go where the same rows as tuples go, in one send per
    server and one hand-over per loop, beside the step's tuples; where each output goes is worked out
    again when the rank's column changes, and a closed loop aborts the column's requests as a server
    that is gone does."""
    closed = CountingLoop()
    closed.close()
    with running_loop() as loop:
        streams, scheduler, sink = streams_of([0, 1, 5], [loop, closed, loop])
        servers = streams.servers = Servers(gone={1})
        for seq_id, server in ((2, 0), (3, 1), (4, 0)):
            scheduler.add(Sequence(seq_id, GenerationRequest(f"r{seq_id}", [1], SamplingParams(max_tokens=8), 0),
                                   64, (0,)))
            streams.traces.arrived(seq_id, f"r{seq_id}", 1)
            streams.add(seq_id, RemoteStream(f"r{seq_id}", server, 10 + seq_id))
        streams.deliver_step([(4, [9], None, None)], [(7, [0, 2, 1, 3, 5], [5, 6, 7, 8, 9])])
        handed = loop.handed
        streams.deliver_step([], [(7, [0, 2, 5], [15, 16, 19])])  # 1 and 3 left the rank: its column changed
        streams.deliver_step([], [(7, [0, 2, 5], [25, 26, 29])])
        got = drained(loop, {0: queue_of(streams, 0), 5: queue_of(streams, 5)})
    assert handed == 1  # one hand-over for the loop's two streams of the column
    assert servers.sent == [(0, StreamOutputs([12, 14], [1, 1], [6, 9])), (1, StreamOutputs([13], [1], [8])),
                            (0, StreamOutputs([12], [1], [16])), (0, StreamOutputs([12], [1], [26]))]
    assert got == {0: [RequestOutput("r0", [5]), RequestOutput("r0", [15]), RequestOutput("r0", [25])],
                   5: [RequestOutput("r5", [9]), RequestOutput("r5", [19]), RequestOutput("r5", [29])]}
    assert set(scheduler.by_id) == {0, 2, 4, 5}  # 1's loop closed, 3's server gone: aborted
    assert sorted((t.seq_id, t.finish_reason) for t in sink.requests) == [(1, "abort"), (3, "abort")]
