"""A client's stream relayed from backends, carried to another backend when its instance dies.

The router asks every backend stream for `return_token_ids` (serve's extension), so it knows
the token ids behind every chunk it forwarded. When a stream's instance fails (its connection
is lost, it sends a 5xx error event, or it stops being ready while the stream waits), each of
its unfinished choices is sent to another backend as a resumed request: the same body for
that choice alone (its prompt, n=1, its own seed), with `resume_output_token_ids` holding the
tokens already forwarded and `resume_request_id` its request's id (a new leader of a controller
group runs that request on already, and the resumed stream attaches to it). serve then samples
as if uninterrupted (the tokens count as output for penalties, min_tokens and max_tokens; a draw
is seeded by (seed, position)) and starts its text where the forwarded text ended, so greedy
and seeded choices go on with the tokens the dead instance would have produced. The client sees
one stream: the first response's id and `created`, its own choice indices, no repeated role
chunk, text offsets continued, and a usage chunk counted here over all the pieces.

A choice moves at most `migration_limit` times; past that the stream ends with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from elastic_ep.model.seeds import choice_seed
from elastic_ep.router.backends import Backend
from elastic_ep.serve.response_ids import response_id

logger = logging.getLogger(__name__)

SERVER_ERROR_TYPES = ("internal_error", "service_unavailable")
"""Error events (serve/errors.py types) that mean the instance failed, not the request."""


@dataclass
class ChoiceState:
    """One choice of the client's response as forwarded so far. `sibling`: its index among the
    choices of its prompt (its seed is the request's seed + sibling)."""

    index: int
    prompt_index: int
    sibling: int
    token_ids: list[int] = field(default_factory=list)
    text_offset: int = 0
    """Where the next token's logprobs `text_offset` lies (serve counts each token's own text)."""
    role_sent: bool = False
    finished: bool = False
    moves: int = 0
    failed_on: set[str] = field(default_factory=set)
    request_id: str = ""
    """Its request's id on the backends, `<response id>-<index>`: known before any backend answers
    (the router names the request, X-Request-Id), so a stream that breaks even before its first
    chunk names it when resumed (`resume_request_id`), and a new leader of a controller group that
    runs it on already attaches the resumed stream to it."""


def choice_states(route: str, body: dict[str, Any], named: str) -> list[ChoiceState]:
    """The choices of a request the router named `named` (its X-Request-Id), prompt-major as serve
    indexes them."""
    n = body.get("n", 1) if isinstance(body.get("n", 1), int) else 1
    prompt = body.get("prompt")
    prompts = len(prompt) if route == "completion" and _is_prompt_list(prompt) else 1
    head = response_id(route, named)
    return [ChoiceState(i * n + j, i, j, request_id=f"{head}-{i * n + j}") for i in range(prompts) for j in range(n)]


def _is_prompt_list(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def resume_body(route: str, backend_body: dict[str, Any], choice: ChoiceState) -> dict[str, Any]:
    """The body that carries `choice` on to another backend (see the module docstring)."""
    body = {**backend_body, "n": 1, "seed": choice_seed(backend_body["seed"], choice.sibling)}
    if route == "completion" and _is_prompt_list(body.get("prompt")):
        body["prompt"] = body["prompt"][choice.prompt_index]
    if choice.token_ids:
        body["resume_output_token_ids"] = list(choice.token_ids)
        body.pop("echo", None)
    # a new leader of a controller group runs the request on already: attach to it
    body["resume_request_id"] = choice.request_id
    body.pop("echo", None)
    return body


class Rewriter:
    """Turns backend chunks into the client's: indices mapped, the first response's id and
    `created`, token ids taken out (kept when the client asked for them), usage counted."""

    def __init__(self, route: str, choices: list[ChoiceState], keep_token_ids: bool):
        self.route = route
        self.choices = choices
        self.keep_token_ids = keep_token_ids
        self.head: dict[str, Any] = {}
        self.prompt_tokens: dict[int, int] = {}

    def rewrite(self, chunk: dict[str, Any], index_map: dict[int, int], offset_shift: dict[int, int]) -> dict | None:
        """The client's chunk for a backend chunk, or None when nothing is left to send (a
        usage chunk, which is recounted at the end; a resumed choice's repeated role)."""
        for key in ("id", "created", "model", "object"):
            self.head.setdefault(key, chunk.get(key))
        out = []
        for c in chunk.get("choices") or []:
            state = self.choices[index_map[c["index"]]]
            prompt_ids = c.pop("prompt_token_ids", None)
            token_ids = c.pop("token_ids", None) or []
            if prompt_ids is not None:
                self.prompt_tokens[state.prompt_index] = len(prompt_ids)
            state.token_ids += token_ids
            c["index"] = state.index
            if self.route == "chat":
                delta = c.get("delta") or {}
                if "role" in delta:
                    if state.role_sent:
                        delta.pop("role")
                        if not delta.get("content") and c.get("finish_reason") is None and not token_ids:
                            continue
                    state.role_sent = True
            else:
                logprobs = c.get("logprobs")
                if logprobs and logprobs["tokens"]:
                    shift = offset_shift.get(state.index, 0)
                    logprobs["text_offset"] = [o + shift for o in logprobs["text_offset"]]
                    state.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if self.keep_token_ids:
                c["token_ids"] = token_ids
                if prompt_ids is not None:
                    c["prompt_token_ids"] = prompt_ids
            if c.get("finish_reason") is not None:
                state.finished = True
            out.append(c)
        if not out:
            return None
        return {**chunk, **{k: self.head[k] for k in ("id", "created")}, "choices": out}

    def usage_chunk(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(len(c.token_ids) for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return {**{k: v for k, v in self.head.items() if v is not None}, "choices": [], "usage": usage}


class BackendFailed(Exception):
    """The backend could not take or carry the request: the request goes elsewhere."""


@dataclass
class ClientError:
    """A backend's 4xx: the request itself is wrong, and the client gets that answer."""

    status: int
    content: bytes
    headers: dict[str, str]


@dataclass(eq=False)
class Attempt:
    """One backend stream carrying some of the client's choices (backend index -> client index)."""

    backend: Backend
    response: httpx.Response
    index_map: dict[int, int]
    offset_shift: dict[int, int]
    release: Callable[[], None]
    task: asyncio.Task | None = None
    closed: bool = False
    heard_s: float = field(default_factory=time.monotonic)
    """When its last chunk (or its opening) arrived."""

    async def close(self) -> None:
        """Close the stream (serve then aborts its requests) and give the backend's slot back."""
        if self.closed:
            return
        self.closed = True
        if self.task is not None:
            self.task.cancel()
        with contextlib.suppress(Exception):
            await self.response.aclose()
        self.release()


async def open_stream(client: httpx.AsyncClient, backend: Backend, path: str, body: dict[str, Any],
                      headers: dict[str, str], connect_timeout_s: float) -> httpx.Response | ClientError:
    """POST a streaming request and wait for its status. 200: the open response; 4xx: the
    backend's answer; anything else raises BackendFailed."""
    request = client.build_request(
        "POST", f"{backend.url}{path}", json=body, headers=headers,
        timeout=httpx.Timeout(connect_timeout_s, read=None, write=connect_timeout_s, pool=connect_timeout_s),
    )
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        raise BackendFailed(f"{type(e).__name__}: {e}") from e
    if response.status_code == 200:
        return response
    try:
        content = await response.aread()
    except httpx.HTTPError as e:
        raise BackendFailed(f"{type(e).__name__}: {e}") from e
    finally:
        await response.aclose()
    if 400 <= response.status_code < 500:
        return ClientError(response.status_code, content, _passed_headers(response))
    raise BackendFailed(f"HTTP {response.status_code}: {content[:200]!r}")


def _passed_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "www-authenticate")}


class StreamFailed(Exception):
    """The stream cannot go on: `body` is the error event the client gets."""

    def __init__(self, body: dict):
        super().__init__(body["error"]["message"])
        self.body = body


OpenResume = Callable[[ChoiceState], Awaitable[Attempt]]
"""Opens a resumed stream for one choice on another backend (raises StreamFailed)."""


class StreamRelay:
    """The client's event stream over `first` and the resumed streams that follow it.

    check_s: a stream that has heard nothing for this long while its instance is not ready
    moves (one that still brings chunks from an instance that is not ready stays).
    """

    def __init__(self, first: Attempt, rewriter: Rewriter, include_usage: bool, open_resume: OpenResume,
                 on_first_token: Callable[[], None], check_s: float = 0.25):
        self.rewriter = rewriter
        self.include_usage = include_usage
        self.open_resume = open_resume
        self.on_first_token = on_first_token
        self.check_s = check_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.attempts: list[Attempt] = []
        self._first_token_seen = False
        self._start(first)

    def _start(self, attempt: Attempt) -> None:
        attempt.task = asyncio.ensure_future(self._read(attempt))
        self.attempts.append(attempt)

    async def _read(self, attempt: Attempt) -> None:
        try:
            async for line in attempt.response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    self.queue.put_nowait(("done", attempt, None))
                    return
                self.queue.put_nowait(("chunk", attempt, json.loads(payload)))
            self.queue.put_nowait(("lost", attempt, "the stream ended without [DONE]"))
        except (httpx.HTTPError, ValueError) as e:
            self.queue.put_nowait(("lost", attempt, f"{type(e).__name__}: {e}"))

    async def events(self) -> AsyncIterator[str]:
        try:
            while not all(c.finished for c in self.rewriter.choices):
                await self._move_silent_on_unready()
                try:
                    kind, attempt, item = await asyncio.wait_for(self.queue.get(), self.check_s)
                except asyncio.TimeoutError:
                    continue
                if attempt.closed:
                    continue
                attempt.heard_s = time.monotonic()
                if kind == "chunk" and "error" in item:
                    if item["error"].get("type") not in SERVER_ERROR_TYPES:
                        yield _sse(item)
                        break
                    await self._move(attempt, f"error event: {item['error'].get('message')}")
                elif kind == "chunk":
                    out = self.rewriter.rewrite(item, attempt.index_map, attempt.offset_shift)
                    if out is not None:
                        if not self._first_token_seen and any(c.get("text") or (c.get("delta") or {}).get(
                                "content") for c in out["choices"]):
                            self._first_token_seen = True
                            self.on_first_token()
                        yield _sse(out)
                elif kind == "done":
                    if any(not self.rewriter.choices[i].finished for i in attempt.index_map.values()):
                        await self._move(attempt, "the stream ended before its choices finished")
                    else:
                        await attempt.close()
                else:
                    await self._move(attempt, item)
            else:
                if self.include_usage:
                    yield _sse(self.rewriter.usage_chunk())
        except StreamFailed as e:
            yield _sse(e.body)
        yield "data: [DONE]\n\n"

    async def _move_silent_on_unready(self) -> None:
        now_s = time.monotonic()
        for attempt in [a for a in self.attempts if not a.closed and not a.backend.ready]:
            if now_s - attempt.heard_s >= self.check_s:
                await self._move(attempt, f"instance not ready ({attempt.backend.reason})")

    async def _move(self, attempt: Attempt, reason: str) -> None:
        """The instance of `attempt` failed: its unfinished choices go on elsewhere."""
        await attempt.close()
        attempt.backend.mark_broken(reason)
        for index in attempt.index_map.values():
            choice = self.rewriter.choices[index]
            if choice.finished:
                continue
            choice.failed_on.add(attempt.backend.url)
            logger.warning("choice %d of %s: %s on %s; resuming after %d tokens", index,
                           self.rewriter.head.get("id"), reason, attempt.backend.url, len(choice.token_ids))
            self._start(await self.open_resume(choice))

    async def close(self) -> None:
        for attempt in self.attempts:
            await attempt.close()


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"

