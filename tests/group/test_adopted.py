"""A new leader runs the last leader's journaled requests on itself (group/adopted.py) and clients
re-attach to them: the tokens after the ones they hold, nothing generated twice, a clear conflict
when they describe another request; the request stays journaled (through a real etcd) so a second
takeover resumes it again; one finished with nobody attached is kept for the orphan window only."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from elastic_ep.control.api import GenerationRequest, RequestOutput, ResumeConflict
from elastic_ep.group.adopted import AdoptedRequests, difference, resume_offset
from elastic_ep.group.journal import Journaled, JournaledEngine, JournalReader, JournalWriter
from elastic_ep.group.store import GroupStore, Seat
from elastic_ep.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)

PARAMS = SamplingParams(max_tokens=8)


def token(request: GenerationRequest, position: int, history: list[int]) -> int:
    """A pure function of seed, position and history, as the real sampler's draws are."""
    return (request.seed * 31 + position * 7 + sum(request.prompt_token_ids) + sum(history)) % 97


class StepEngine:
    """One token per event, each after `step` is set when `paced`; it counts what it generates and
    which requests were aborted (closed before their end)."""

    info = "info"

    def __init__(self, paced: bool = False):
        self.paced, self.step = paced, asyncio.Event()
        self.generated: dict[str, int] = {}
        self.aborted: list[str] = []

    async def generate(self, request: GenerationRequest):
        output, done = list(request.resumed_output_token_ids), False
        try:
            while not done:
                if self.paced:
                    await self.step.wait()
                    self.step.clear()
                else:
                    await asyncio.sleep(0)
                output.append(token(request, len(output), output))
                self.generated[request.request_id] = self.generated.get(request.request_id, 0) + 1
                done = len(output) >= request.params.max_tokens
                yield RequestOutput(request.request_id, [output[-1]], done, "length" if done else None)
        finally:
            if not done:
                self.aborted.append(request.request_id)


def fault_free(request: GenerationRequest) -> list[int]:
    output: list[int] = []
    while len(output) < request.params.max_tokens:
        output.append(token(request, len(output), output))
    return output


def leading(url: str) -> tuple[GroupStore, int]:
    store = GroupStore(url, "g")
    return store, store.campaign(Seat("a", "http://a:1"), store.grant(30)).create_revision


def journaled(request_id: str = "cmpl-a-0", tokens: int = 3) -> Journaled:
    request = GenerationRequest(request_id, [3, 4], PARAMS, 11)
    return Journaled(request_id, [3, 4], PARAMS, 11, fault_free(request)[:tokens])


def reattach(held: Journaled, given: list[int], **changes) -> GenerationRequest:
    fields = {"prompt_token_ids": held.prompt_token_ids, "params": held.params, "seed": held.seed, **changes}
    return GenerationRequest(held.request_id, resumed_output_token_ids=tuple(given), reattach=True, **fields)


async def drain(events) -> list[RequestOutput]:
    return [out async for out in events]


def counts(adopted: AdoptedRequests) -> dict[str, float]:
    return {by: adopted.resumed.labels(by=by)._value.get() for by in ("leader", "attach", "client")}


def test_the_offset_a_client_goes_on_from_and_what_a_reattach_may_change():
    assert resume_offset([1, 2, 3], False, [1, 2]) == 2
    assert resume_offset([1, 2, 3], True, []) == 0
    assert resume_offset([1, 2], False, [1, 2, 3]) is None  # it runs on: wait for the third token
    with pytest.raises(ResumeConflict, match="position 1"):
        resume_offset([1, 2, 3], False, [1, 5])
    with pytest.raises(ResumeConflict, match="finished after 2"):
        resume_offset([1, 2], True, [1, 2, 3])
    held = GenerationRequest("r", [1], SamplingParams(seed=None), 5)
    assert difference(held, GenerationRequest("r", [1], SamplingParams(seed=5), 5)) is None  # the client's seed
    assert difference(held, GenerationRequest("r", [2], SamplingParams(), 5)) == "prompt"
    assert difference(held, GenerationRequest("r", [1], SamplingParams(), 6)) == "seed"
    assert difference(held, GenerationRequest("r", [1], SamplingParams(max_tokens=3), 5)) == "parameters"


def test_the_new_leader_runs_a_journaled_request_to_its_end_alone_and_keeps_journaling_it(etcd):
    """Unattended it goes on from the journal's tokens to the fault-free output, every entry journaled
    (a second takeover would find it); a client that comes back later gets only what it lacks."""
    store, term = leading(etcd.url)
    held = journaled(tokens=3)
    writer = JournalWriter(store, term, requests={held.request_id: held})
    engine, adopted = StepEngine(paced=True), AdoptedRequests(CollectorRegistry())
    journaling = JournaledEngine(engine, writer, adopted)
    expected = fault_free(held.resumed())

    async def run() -> None:
        adopted.start([held.resumed()], journaling.generate, journaling.forget)
        while engine.generated.get(held.request_id, 0) < 2:
            engine.step.set()
            await asyncio.sleep(0)
        assert adopted.get(held.request_id).output == expected[:5]
        writer.flush()  # mid-run: a standby's journal holds it unfinished with the tokens run on here
        second = JournalReader(GroupStore(etcd.url, "g"))
        second.catch_up()
        assert second.requests[held.request_id].output_token_ids == expected[:5]
        assert second.requests[held.request_id].resumed() == GenerationRequest(held.request_id, [3, 4], PARAMS, 11,
                                                                              tuple(expected[:5]))
        while adopted.get(held.request_id).last is None:
            engine.step.set()
            await asyncio.sleep(0)
        assert adopted.get(held.request_id).output == expected  # nobody attached: it ran to its end
        # the client had 4 tokens (one past the journal's): it gets the other 4, nothing runs again
        events = await drain(await adopted.attach(reattach(held, expected[:4])))
        assert [t for e in events for t in e.new_token_ids] == expected[4:]
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert engine.generated == {held.request_id: len(expected) - 3}

    asyncio.run(run())
    writer.flush()
    reader = JournalReader(GroupStore(etcd.url, "g"))
    reader.catch_up()
    assert held.request_id not in reader.requests  # finished: it left the journal
    assert counts(adopted) == {"leader": 1, "attach": 1, "client": 0}


def test_a_client_attaches_to_the_running_request_and_waits_for_the_tokens_it_is_ahead_by(etcd):
    store, term = leading(etcd.url)
    held = journaled(tokens=2)
    engine, adopted = StepEngine(paced=True), AdoptedRequests(CollectorRegistry())
    journaling = JournaledEngine(engine, JournalWriter(store, term), adopted)
    expected = fault_free(held.resumed())

    async def run() -> list[int]:
        adopted.start([held.resumed()], journaling.generate, journaling.forget)
        # the client received 4 tokens, two past the journal's last batch: nothing comes until the
        # request has regenerated them (the same ones), then only what follows
        events = journaling.generate(reattach(held, expected[:4]))
        first = asyncio.ensure_future(anext(events))
        got: list[int] = []
        while not first.done():
            engine.step.set()
            await asyncio.sleep(0)
        out = first.result()
        got += out.new_token_ids
        while not out.finished:
            engine.step.set()
            out = await anext(events)
            got += out.new_token_ids
        await events.aclose()
        return got

    assert asyncio.run(run()) == expected[4:]
    assert engine.generated == {held.request_id: len(expected) - 2} and engine.aborted == []


def test_a_resume_that_describes_another_request_is_a_conflict_and_the_request_runs_on(etcd):
    store, term = leading(etcd.url)
    held = journaled(tokens=3)
    engine, adopted = StepEngine(paced=True), AdoptedRequests(CollectorRegistry())
    journaling = JournaledEngine(engine, JournalWriter(store, term), adopted)
    expected = fault_free(held.resumed())

    async def run() -> None:
        adopted.start([held.resumed()], journaling.generate, journaling.forget)
        wrong = [*expected[:2], (expected[2] + 1) % 97]
        with pytest.raises(ResumeConflict, match="position 2") as e:
            await drain(journaling.generate(reattach(held, wrong)))
        assert e.value.param == "resume_output_token_ids"
        with pytest.raises(ResumeConflict, match="another seed"):
            await drain(journaling.generate(reattach(held, expected[:3], seed=12)))
        with pytest.raises(ResumeConflict, match="another prompt"):
            await drain(journaling.generate(reattach(held, [], prompt_token_ids=[9])))
        first = journaling.generate(reattach(held, expected[:3]))
        assert (await anext(first)).new_token_ids == []  # attached: the answer starts at once
        with pytest.raises(ResumeConflict, match="attached to another client"):
            await drain(journaling.generate(reattach(held, expected[:3])))
        engine.step.set()
        assert (await anext(first)).new_token_ids == expected[3:4]
        await first.aclose()

    asyncio.run(run())
    assert engine.aborted == [held.request_id]  # attached, then its client left: aborted as any request


def test_a_request_whose_client_left_is_aborted_and_a_later_resume_runs_it_anew_under_its_id(etcd):
    store, term = leading(etcd.url)
    held, early = journaled(tokens=3), journaled("cmpl-b-0", tokens=3)
    writer = JournalWriter(store, term, requests={held.request_id: held, early.request_id: early})
    engine, adopted = StepEngine(paced=True), AdoptedRequests(CollectorRegistry())
    journaling = JournaledEngine(engine, writer, adopted)
    expected = fault_free(held.resumed())

    async def run() -> list[int]:
        adopted.start([early.resumed()], journaling.generate, journaling.forget)
        # its client attaches and leaves before the request began here: nothing to abort in the
        # engine, and the journal is told it ended
        events = journaling.generate(reattach(early, early.output_token_ids))
        assert (await anext(events)).new_token_ids == []
        await events.aclose()
        adopted.start([held.resumed()], journaling.generate, journaling.forget)
        while not engine.generated.get(held.request_id):
            engine.step.set()
            await asyncio.sleep(0)
        first = journaling.generate(reattach(held, expected[:4]))
        assert (await anext(first)).new_token_ids == []
        await first.aclose()
        while held.request_id not in engine.aborted:
            await asyncio.sleep(0)
        assert adopted.get(held.request_id) is None and adopted.get(early.request_id) is None
        writer.flush()
        reader = JournalReader(GroupStore(etcd.url, "g"))
        reader.catch_up()
        assert reader.requests == {}  # both ended in the journal: a takeover now resumes neither
        engine.paced = False
        return [t for e in await drain(journaling.generate(reattach(held, expected[:5]))) for t in e.new_token_ids]

    assert asyncio.run(run()) == expected[5:]
    assert engine.aborted == [held.request_id] and "cmpl-b-0" not in engine.generated
    assert counts(adopted) == {"leader": 2, "attach": 2, "client": 1}


def test_a_request_finished_with_nobody_attached_is_kept_for_the_orphan_window_then_dropped(etcd):
    store, term = leading(etcd.url)
    held = journaled(tokens=3)
    now = [0.0]
    engine, adopted = StepEngine(), AdoptedRequests(CollectorRegistry(), keep_s=300, clock=lambda: now[0])
    journaling = JournaledEngine(engine, JournalWriter(store, term), adopted)

    async def run() -> None:
        adopted.start([held.resumed()], journaling.generate, journaling.forget)
        while adopted.get(held.request_id).last is None:
            await asyncio.sleep(0)
        now[0] = 299.0
        assert adopted.get(held.request_id) is not None
        now[0] = 301.0
        assert adopted.get(held.request_id) is None
        assert await adopted.attach(reattach(held, [])) is None  # the caller runs it anew

    asyncio.run(run())
