"""The request journal through a real etcd: batches a standby applies in order, a snapshot that
compacts them, a deposed leader's batch refused by etcd, the engine wrapper that records
each request and its tokens, and a request finished with nobody attached kept across takeovers."""

import asyncio

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from elastic_ep.control.api import GenerationRequest, RequestOutput
from elastic_ep.group.adopted import AdoptedRequests
from elastic_ep.group.journal import (
    KEEP_S,
    Admitted,
    Delivered,
    Deposed,
    Journaled,
    JournaledEngine,
    JournalReader,
    JournalWriter,
    Kept,
    Snapshot,
    apply,
    unexpired,
)
from elastic_ep.group.store import GroupStore, Seat
from elastic_ep.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)


def leading(url: str) -> tuple[GroupStore, int]:
    """A store of group g whose leader key this test holds; its term."""
    store = GroupStore(url, "g")
    held = store.campaign(Seat("a", "http://a:1"), store.grant(30))
    return store, held.create_revision


def test_a_standby_applies_the_batches_in_order_and_a_snapshot_compacts_them(etcd):
    store, term = leading(etcd.url)
    writer = JournalWriter(store, term, snapshot_every=3)
    reader = JournalReader(GroupStore(etcd.url, "g"))
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=5)
    writer.add(Admitted("r1", [1, 2, 3], params, 5, []))
    writer.add(Admitted("r2", [4], SamplingParams(), 9, [7]))
    assert writer.flush() and not writer.flush()  # nothing new: no batch
    writer.add(Delivered("r1", [10, 11], False))
    writer.add(Delivered("r2", [8], True))
    assert writer.flush() and writer.seq == 2
    reader.catch_up()
    assert reader.applied == 2 and set(reader.requests) == {"r1"}
    r1 = reader.requests["r1"]
    assert (r1.prompt_token_ids, r1.output_token_ids, r1.seed, r1.params) == ([1, 2, 3], [10, 11], 5, params)
    writer.add(Delivered("r1", [12], False))
    assert writer.flush() and writer.seq == 3  # the third batch: a snapshot, the batches deleted
    assert not [k for k in store.get_prefix(store.prefix + "journal/")]
    late = JournalReader(GroupStore(etcd.url, "g"))  # a standby that starts now reads the snapshot
    late.catch_up()
    assert late.applied == 3 and late.requests["r1"].output_token_ids == [10, 11, 12]
    writer.add(Delivered("r1", [13], False))
    writer.flush()
    reader.catch_up()
    assert reader.applied == 4 and reader.requests["r1"].output_token_ids == [10, 11, 12, 13]


def test_etcd_refuses_the_batch_of_a_deposed_leader(etcd):
    store, term = leading(etcd.url)
    old = JournalWriter(store, term - 1)  # a term that does not hold the leader key
    old.add(Delivered("r", [1], False))
    with pytest.raises(Deposed):
        old.flush()
    assert not store.get_prefix(store.prefix + "journal")


class Engine:
    """A stand-in engine: two events per request."""

    info = "info"

    async def generate(self, request):
        yield RequestOutput(request.request_id, [5, 6])
        yield RequestOutput(request.request_id, [7], True, "length")

    def readiness(self):
        return "ready"


def test_the_journaled_engine_records_each_request_and_its_tokens(etcd):
    store, term = leading(etcd.url)
    writer = JournalWriter(store, term)
    engine = JournaledEngine(Engine(), writer)
    request = GenerationRequest("r9", [1, 2], SamplingParams(max_tokens=3), 42, (4,))

    async def run():
        return [out async for out in engine.generate(request)]

    assert [o.new_token_ids for o in asyncio.run(run())] == [[5, 6], [7]]
    assert engine.readiness() == "ready" and engine.info == "info"
    writer.flush()
    reader = JournalReader(GroupStore(etcd.url, "g"))
    reader.catch_up()
    assert reader.applied == 1 and reader.requests == {}  # finished: it left the journal
    assert writer.shipped_entries == 3


def test_a_backlog_over_etcds_request_limit_ships_as_several_batches_in_order(etcd):
    store, term = leading(etcd.url)
    writer = JournalWriter(store, term)
    writer.add(Admitted("big", list(range(1000)), SamplingParams(max_tokens=10**5), 1, []))
    for i in range(60_000):  # some 1.9 MB of entries: one request would be refused
        writer.add(Delivered("big", [i % 50_000], False))
    assert writer.flush() and writer.seq > 1
    reader = JournalReader(GroupStore(etcd.url, "g", timeout_s=5))
    reader.catch_up()
    assert reader.applied == writer.seq and reader.requests["big"].output_token_ids == [i % 50_000
                                                                                      for i in range(60_000)]


class Counting:
    """A stand-in engine: request r's token at position p is (seed + p) % 50, one per event."""

    info = "info"

    def __init__(self):
        self.generated = 0

    async def generate(self, request):
        output = list(request.resumed_output_token_ids)
        while len(output) < request.params.max_tokens:
            output.append((request.seed + len(output)) % 50)
            self.generated += 1
            done = len(output) == request.params.max_tokens
            yield RequestOutput(request.request_id, [output[-1]], done, "length" if done else None)
            await asyncio.sleep(0)


def test_a_request_finished_with_nobody_attached_outlives_a_second_takeover_for_a_while(etcd):
    """The first new leader runs a journaled request to its end with nobody attached: the journal keeps
    it finished (tokens, finish reason); after a second takeover the client re-attaches and gets the
    tokens it lacks, with nothing generated again. Kept MAX_KEPT at most, KEEP_S at most."""
    store, term = leading(etcd.url)
    params = SamplingParams(max_tokens=6)
    expected = [(9 + p) % 50 for p in range(6)]
    held = Journaled("cmpl-x-0", [1, 2], params, 9, expected[:2])
    first = JournalWriter(store, term, requests={held.request_id: held})
    adopted = AdoptedRequests(CollectorRegistry())
    engine = JournaledEngine(Counting(), first, adopted)

    async def run_unattended():
        adopted.start([held.resumed()], engine.generate, engine.forget)
        while adopted.get(held.request_id).last is None:
            await asyncio.sleep(0)

    asyncio.run(run_unattended())
    first.flush()
    standby = JournalReader(GroupStore(etcd.url, "g"))  # the second new leader's copy
    standby.catch_up()
    assert held.request_id not in standby.requests
    kept = standby.kept[held.request_id]
    assert (kept.output_token_ids, kept.finished, kept.finish_reason) == (expected, True, "length")

    second_engine, second = Counting(), AdoptedRequests(CollectorRegistry())
    second.hold_finished(kept.resumed(), kept.finish_reason, 1.0)
    journaling = JournaledEngine(second_engine, JournalWriter(store, term, standby.applied, standby.requests,
                                                             kept=standby.kept), second)
    asked = GenerationRequest(held.request_id, [1, 2], params, 9, tuple(expected[:3]), reattach=True)

    async def reattach():
        return [out async for out in journaling.generate(asked)]

    events = asyncio.run(reattach())
    assert [t for e in events for t in e.new_token_ids] == expected[3:]
    assert events[-1].finished and events[-1].finish_reason == "length" and second_engine.generated == 0
    # a third leader would find it too: the next snapshot carries it
    snapshot = msgspec.msgpack.decode(journaling.writer.snapshot(), type=Snapshot)
    assert [r.request_id for r in snapshot.kept] == [held.request_id]

    # bounded: the oldest go first past max_kept, and none outlives KEEP_S
    requests = {f"r{i}": Journaled(f"r{i}", [1], params, i, []) for i in range(3)}
    bounded: dict = {}
    apply(requests, bounded, [Kept(f"r{i}", [i], "stop", 100.0 + i) for i in range(3)], max_kept=2)
    assert list(bounded) == ["r1", "r2"] and not requests
    assert list(unexpired(bounded, 101.0 + KEEP_S + 0.5)) == ["r2"]
