"""The last leader's unfinished requests, run on by the new leader of a controller group, and the
clients that re-attach to them.

At takeover (commands/serve_group.py) every request the journal holds unfinished is submitted to
this leader's engine at once (`start`), through the journaling wrapper (group/journal.py), so it
stays journaled and a second takeover resumes it again: its prompt, parameters and seed, and the
journaled tokens as resumed output, so it goes on with the tokens the uninterrupted request would
have had (a token is a pure function of seed, position and history), whether or not its client is
connected. A client that comes back names the request (serve's `resume_request_id`) with the tokens
it already has; `attach` answers from the running request: the tokens after those (`resume_offset`
checks them against the request's own), then each new one, so nothing runs twice and nothing the
client has comes again. A request that finishes with nobody attached is kept finished for `keep_s`
(readable by GET /journal/{id} and a re-attach), then dropped; one that a client attached to and
left is aborted, as any request whose client left.

Everything here runs on the HTTP server's event loop (`start` is called from the takeover thread
with that loop), so no lock: an asyncio.Condition per request wakes its attached client."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from elastic_ep.control.api import GenerationRequest, RequestOutput, ResumeConflict, ServiceUnavailable
from elastic_ep.model.sampling import TokenLogprobs

logger = logging.getLogger(__name__)

Generate = Callable[[GenerationRequest], AsyncIterator[RequestOutput]]


def resume_offset(held: list[int], done: bool, given: list[int]) -> int | None:
    """Where a client that holds the output tokens `given` goes on in `held`, the request's output so
    far (`done`: all of it): len(given) once `held` reaches that far; None while it does not yet (the
    request runs on: wait). Raises ResumeConflict where they disagree, or when a finished request
    is shorter than what was given."""
    common = min(len(held), len(given))
    if held[:common] != given[:common]:
        at = next(i for i in range(common) if held[i] != given[i])
        raise ResumeConflict(
            f"resume_output_token_ids disagree with the request's own tokens at position {at} ({given[at]} given, "
            f"{held[at]} generated): send the tokens this request's stream delivered, or start a new request",
            "resume_output_token_ids")
    if len(given) <= len(held):
        return len(given)
    if done:
        raise ResumeConflict(f"resume_output_token_ids hold {len(given)} tokens; the request finished after "
                             f"{len(held)}: send the tokens its stream delivered", "resume_output_token_ids")
    return None


def difference(held: GenerationRequest, asked: GenerationRequest) -> str | None:
    """What a re-attach describes otherwise than the request held ("prompt", "seed", "parameters"),
    None when nothing. The parameters' own `seed` is the client's and may be unset where the
    request's seed was drawn, so only the request's seed counts."""
    if list(held.prompt_token_ids) != list(asked.prompt_token_ids):
        return "prompt"
    if held.seed != asked.seed:
        return "seed"
    if dataclasses.replace(held.params, seed=None) != dataclasses.replace(asked.params, seed=None):
        return "parameters"
    return None


@dataclass(eq=False)
class Adopted:
    """A journaled request this leader runs on. `output`: every output token, the journal's first
    (`base` of them), then this leader's; `logprobs`: those of output[base:] when the request asked
    for logprobs (the journal holds none); `last`: its finishing event."""

    request: GenerationRequest
    output: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: RequestOutput | None = None
    finished_s: float | None = None
    attached: bool = False
    task: asyncio.Task | None = None
    began: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def base(self) -> int:
        return len(self.request.resumed_output_token_ids)

    def event(self, start: int, end: int) -> RequestOutput:
        """output[start:end] as one event (the last one when it reaches a finished request's end)."""
        last = self.last if self.last is not None and end == len(self.output) else None
        wanted = self.request.params.logprobs is not None
        logprobs = self.logprobs[start - self.base:end - self.base] if wanted else None
        return RequestOutput(self.request.request_id, self.output[start:end], last is not None,
                             last.finish_reason if last else None, last.error if last else None, logprobs)


class AdoptedRequests:
    """The requests this leader took over from the journal, by request id. `keep_s`: how long a
    finished one is kept, and how long one the engine keeps refusing (not ready) is retried;
    `retry_s`: the wait between such tries."""

    def __init__(self, registry: CollectorRegistry, keep_s: float = 300.0, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.keep_s, self.retry_s, self._clock = keep_s, retry_s, clock
        self.held: dict[str, Adopted] = {}
        self.resumed = Counter("elastic_ep_requests_resumed", "Requests resumed from their tokens, by who resumed "
                               "them: leader (a new controller-group leader ran on a journaled request itself), "
                               "attach (a client re-attached to such a request), client (a client's resume run anew)",
                               ["by"], registry=registry)

    def start(self, journaled: Iterable[GenerationRequest], generate: Generate, forget: Callable[[str], None]) -> None:
        """Run each request on through `generate` (on the running loop), its resumed output the
        journal's tokens. `forget(request_id)`: the journal's end of one aborted before it began
        (`generate` journals the others)."""
        for request in journaled:
            adopted = self.held[request.request_id] = Adopted(request, list(request.resumed_output_token_ids))
            adopted.task = asyncio.ensure_future(self._run(adopted, generate))
            adopted.task.add_done_callback(lambda _, a=adopted: None if a.began else forget(a.request.request_id))
            self.resumed.labels(by="leader").inc()

    def hold_finished(self, request: GenerationRequest, finish_reason: str, age_s: float) -> None:
        """A request a last leader finished with nobody attached, as the journal kept it (its output the
        request's resumed output): held finished for what is left of `keep_s` `age_s` after it
        finished, for GET /journal/{id} and a client's re-attach."""
        self.held[request.request_id] = Adopted(
            request, list(request.resumed_output_token_ids),
            last=RequestOutput(request.request_id, [], True, finish_reason), finished_s=self._clock() - age_s)

    def start_threadsafe(self, journaled: list[GenerationRequest], generate: Generate, forget: Callable[[str], None],
                         loop: asyncio.AbstractEventLoop) -> None:
        """`start` from another thread, on `loop` (the HTTP server's); returns once they are submitted."""

        async def submit() -> None:
            self.start(journaled, generate, forget)

        asyncio.run_coroutine_threadsafe(submit(), loop).result()

    async def _run(self, adopted: Adopted, generate: Generate) -> None:
        adopted.began = True
        request, until_s = adopted.request, self._clock() + self.keep_s
        try:
            while True:
                try:
                    async for out in generate(request):
                        async with adopted.changed:
                            adopted.output += out.new_token_ids
                            adopted.logprobs += out.logprobs or []
                            if out.finished:
                                adopted.last, adopted.finished_s = out, self._clock()
                            adopted.changed.notify_all()
                    return
                except ServiceUnavailable as e:  # not ready yet (the adopting epoch forms): try again
                    if self._clock() > until_s:
                        raise
                    logger.info("journaled request %s waits for the engine: %s", request.request_id, e)
                    await asyncio.sleep(self.retry_s)
        except asyncio.CancelledError:  # its client attached and left: aborted, as any request
            self.held.pop(request.request_id, None)
            raise
        except Exception as e:
            logger.warning("journaled request %s could not go on: %s", request.request_id, e)
            async with adopted.changed:
                adopted.last = RequestOutput(request.request_id, [], True, "error", f"{type(e).__name__}: {e}")
                adopted.finished_s = self._clock()
                adopted.changed.notify_all()

    def get(self, request_id: str) -> Adopted | None:
        self._sweep()
        return self.held.get(request_id)

    def _sweep(self) -> None:
        now_s = self._clock()
        for request_id in [i for i, a in self.held.items() if a.finished_s is not None
                           and now_s - a.finished_s > self.keep_s]:
            del self.held[request_id]

    async def attach(self, asked: GenerationRequest) -> AsyncIterator[RequestOutput] | None:
        """The events of the held request `asked` names, from the tokens after the ones it gives; None
        when none is held under its id (the caller runs it anew). Raises ResumeConflict when it
        describes another request or another client is attached."""
        adopted = self.get(asked.request_id)
        if adopted is None:
            return None
        differs = difference(adopted.request, asked)
        if differs is not None:
            raise ResumeConflict(f"request {asked.request_id} was started with another {differs}: resume it with "
                                 f"the prompt, seed and parameters GET /journal/{asked.request_id} gives")
        if adopted.attached:
            raise ResumeConflict(f"request {asked.request_id} is attached to another client; it runs on there")
        given = list(asked.resumed_output_token_ids)
        if asked.params.logprobs is not None and len(given) < adopted.base and adopted.last is None:
            # the logprobs of the journaled tokens the client lacks are not held: run those again
            await self._abort(adopted)
            return None
        adopted.attached = True
        return self._follow(adopted, given)

    async def _follow(self, adopted: Adopted, given: list[int]) -> AsyncIterator[RequestOutput]:
        attached = False
        try:
            async with adopted.changed:
                await adopted.changed.wait_for(
                    lambda: resume_offset(adopted.output, adopted.last is not None, given) is not None)
            sent = len(given)
            attached = True
            self.resumed.labels(by="attach").inc()
            logger.info("request %s: a client re-attached after %d tokens; %d generated so far%s",
                        adopted.request.request_id, sent, len(adopted.output),
                        " (finished)" if adopted.last is not None else "")
            while True:
                end = len(adopted.output)
                out = adopted.event(sent, end)
                yield out
                if out.finished:
                    return
                sent = end
                async with adopted.changed:
                    await adopted.changed.wait_for(lambda n=sent: len(adopted.output) > n or adopted.last is not None)
        finally:
            adopted.attached = False
            if attached and adopted.last is None and adopted.task is not None:
                self.held.pop(adopted.request.request_id, None)
                adopted.task.cancel()

    async def _abort(self, adopted: Adopted) -> None:
        self.held.pop(adopted.request.request_id, None)
        if adopted.task is not None:
            adopted.task.cancel()
            await asyncio.wait([adopted.task])
