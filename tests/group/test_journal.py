"""The request journal through a real etcd: batches a standby applies in order, a snapshot that
compacts them, a deposed leader's batch refused by etcd, and the engine wrapper that records
each request and its tokens."""

import asyncio

import pytest

from elastic_ep.control.api import GenerationRequest, RequestOutput
from elastic_ep.group.journal import Admitted, Delivered, Deposed, JournaledEngine, JournalReader, JournalWriter
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
