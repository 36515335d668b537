"""The router's HTTP server: serve's OpenAI routes (bodies passed through), in front of `serve`
instances, plus its own operator routes.

- /v1/completions, /v1/chat/completions: a backend is chosen (router/scoring.py, through the
  queue of router/admission.py); a request that fails before it starts (connection refused, a
  5xx) goes to another backend, a stream that fails mid-way is carried on (router/relay.py).
  A backend's 4xx (bad input) is the client's answer; no ready backend is a 503 and a
  saturated router a 429, both with Retry-After.
- /tokenize, /detokenize, /v1/models: any ready backend (they hold the same model).
- /health (the router runs), /ready (some backend is ready), /metrics (the router's own),
  /router (settings and backends), GET/POST/DELETE /backends. With `--api-key`, /v1/* and
  changes to the backends need `Authorization: Bearer KEY`.

The router sets each request's seed when the client gives none (so a moved stream draws what
it would have drawn) and its X-Request-Id (so every instance names the response alike).
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from elastic_ep import __version__
from elastic_ep.router.admission import Admission, NoBackend, Saturated
from elastic_ep.router.backends import Backend, BackendPool
from elastic_ep.router.config import RouterConfig
from elastic_ep.router.metrics import RouterMetrics
from elastic_ep.router.relay import (
    Attempt,
    BackendFailed,
    ChoiceState,
    ClientError,
    Rewriter,
    StreamFailed,
    StreamRelay,
    choice_states,
    open_stream,
    resume_body,
)
from elastic_ep.router.scoring import prefix_key, prompt_material, rendezvous_order, user_key
from elastic_ep.serve.errors import error_body
from elastic_ep.serve.prefix_keys import HEADER as PREFIX_KEY_HEADER
from elastic_ep.serve.streaming import EventStreamResponse

logger = logging.getLogger(__name__)


class BackendBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    url: str


def _error(status: int, message: str, code: str, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(status, message, code=code), status_code=status, headers=headers)


class Router:
    """The routing core the HTTP routes call; `start` / `stop` run the backend poll loop."""

    def __init__(self, cfg: RouterConfig, registry: CollectorRegistry):
        self.cfg = cfg
        self.metrics = RouterMetrics(registry)
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.pool = BackendPool(self.client, poll_interval_s=cfg.poll_interval_s, poll_timeout_s=cfg.poll_timeout_s,
                                backends_file=cfg.backends_file, on_change=self._changed, live_s=cfg.prefix_live_s)
        self.admission = Admission(self.pool, cfg.limits, queue_size=cfg.queue_size, live_s=cfg.prefix_live_s,
                                   queue_timeout_s=cfg.queue_timeout_s, retry_after_s=cfg.retry_after_s)
        for url in cfg.backends:
            self.pool.add(url, "cli")
        self.metrics.queued.set_function(lambda: self.admission.waiting)
        self.metrics.ready.set_function(lambda: len(self.pool.ready()))
        self.metrics.backends.set_function(lambda: len(self.pool.backends))

    def _changed(self) -> None:
        self.admission.notify()

    async def start(self) -> None:
        await self.pool.poll_once()
        self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await self.client.aclose()

    def authorized(self, request: Request) -> bool:
        if not self.cfg.api_key:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.cfg.api_key}".encode())

    def backend_headers(self, request: Request, request_id: str | None = None) -> dict[str, str]:
        headers = {}
        if self.cfg.backend_api_key:
            headers["authorization"] = f"Bearer {self.cfg.backend_api_key}"
        elif not self.cfg.api_key and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        if request_id is not None:
            headers["x-request-id"] = request_id
        return headers

    def key_of(self, route: str, body: dict[str, Any]) -> tuple[bytes, str | None]:
        user = body.get("user")
        if isinstance(user, str) and user:
            return user_key(user), user
        return prefix_key(prompt_material(route, body), self.cfg.block_bytes, self.cfg.affinity_blocks), None

    async def acquire(self, key: bytes, user: str | None, exclude: set[str], resuming: bool = False) -> Backend:
        backend = await self.admission.acquire(key, user, exclude, resuming)
        self.metrics.sent.labels(backend=backend.url).inc()
        return backend

    async def generate(self, route: str, path: str, request: Request) -> Response:
        arrived_s = time.monotonic()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            # Not for the router to judge: the backend's 400 says what is wrong.
            return await self.forward("POST", path, request, raw)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = self.backend_headers(request, request_id)
        backend_body = dict(body)
        if backend_body.get("seed") is None:
            backend_body["seed"] = secrets.randbits(63)
        stream = body.get("stream") is True
        if stream:
            backend_body["return_token_ids"] = True
        key, user = self.key_of(route, body)
        headers[PREFIX_KEY_HEADER] = key.hex()  # what each backend counts, for every router to read
        failed: set[str] = set()
        while True:
            try:
                backend = await self.acquire(key, user, failed)
            except NoBackend as e:
                self.metrics.rejected.labels(status="503").inc()
                return _error(503, str(e), "no_backend", e.retry_after_s)
            except Saturated as e:
                self.metrics.rejected.labels(status="429").inc()
                return _error(429, str(e), "saturated", e.retry_after_s)
            try:
                if stream:
                    result = await open_stream(self.client, backend, path, backend_body, headers,
                                               self.cfg.connect_timeout_s)
                else:
                    result = await self._post(backend, path, backend_body, headers)
            except BackendFailed as e:
                self.admission.release(backend)
                backend.mark_broken(str(e))
                failed.add(backend.url)
                if len(failed) > self.cfg.migration_limit:
                    return _error(503, f"the request failed on {len(failed)} backends (--migration-limit "
                                       f"{self.cfg.migration_limit}); last: {backend.url}: {e}",
                                  "backends_failed", self.cfg.retry_after_s)
                self.metrics.moves.inc()
                continue
            if not stream or isinstance(result, ClientError):
                self.admission.release(backend)
                if isinstance(result, ClientError):
                    return Response(result.content, result.status, result.headers, media_type="application/json")
                return result
            break
        return self._relay(route, path, body, backend_body, headers, key, user, backend, result, arrived_s,
                           request_id)

    def _relay(self, route: str, path: str, body: dict[str, Any], backend_body: dict[str, Any],
               headers: dict[str, str], key: bytes, user: str | None, backend: Backend,
               response: httpx.Response, arrived_s: float, request_id: str) -> Response:
        choices = choice_states(route, body, request_id)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True

        async def open_resume(choice: ChoiceState) -> Attempt:
            while True:
                if choice.moves >= self.cfg.migration_limit:
                    raise StreamFailed(error_body(
                        503, f"choice {choice.index} lost its instance {choice.moves + 1} times (--migration-limit "
                             f"{self.cfg.migration_limit}); retry the request", code="migration_limit"))
                choice.moves += 1
                self.metrics.moves.inc()
                try:
                    target = await self.acquire(key, user, choice.failed_on, resuming=True)
                except (NoBackend, Saturated) as e:
                    raise StreamFailed(error_body(503, f"the stream cannot go on: {e}", code="no_backend")) from e
                body = resume_body(route, backend_body, choice)
                try:
                    opened = await open_stream(self.client, target, path, body, headers, self.cfg.connect_timeout_s)
                    if _resume_conflict(opened):
                        # the backend holds that request otherwise (it runs on for a connection it has not
                        # seen close): a copy of its own from the tokens forwarded, exact all the same
                        body.pop("resume_request_id")
                        opened = await open_stream(self.client, target, path, body, headers,
                                                   self.cfg.connect_timeout_s)
                except BackendFailed as e:
                    self.admission.release(target)
                    target.mark_broken(str(e))
                    choice.failed_on.add(target.url)
                    continue
                if isinstance(opened, ClientError):
                    self.admission.release(target)
                    raise StreamFailed(_error_of(opened))
                return Attempt(target, opened, {0: choice.index}, {choice.index: choice.text_offset},
                               functools.partial(self.admission.release, target))

        first = Attempt(backend, response, {c.index: c.index for c in choices}, {},
                        functools.partial(self.admission.release, backend))
        relay = StreamRelay(
            first, Rewriter(route, choices, keep_token_ids=body.get("return_token_ids") is True),
            include_usage, open_resume,
            on_first_token=lambda: self.metrics.time_to_first_token_s.observe(time.monotonic() - arrived_s),
            check_s=self.cfg.stream_check_s,
        )
        return EventStreamResponse(relay.events(), on_close=relay.close)

    async def _post(self, backend: Backend, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        try:
            r = await self.client.post(f"{backend.url}{path}", json=body, headers=headers,
                                       timeout=self.cfg.request_timeout_s)
        except httpx.HTTPError as e:
            raise BackendFailed(f"{type(e).__name__}: {e}") from e
        if r.status_code >= 500:
            raise BackendFailed(f"HTTP {r.status_code}: {r.content[:200]!r}")
        return _passed(r)

    async def forward(self, method: str, path: str, request: Request, content: bytes | None = None) -> Response:
        """A request any backend answers alike, to the ready ones in turn until one answers."""
        order = {b.url: b for b in self.pool.ready()}
        if not order:
            return _error(503, "no backend is ready", "no_backend", self.cfg.retry_after_s)
        headers = self.backend_headers(request)
        if content is not None:
            headers["content-type"] = request.headers.get("content-type", "application/json")
        last = ""
        for url in rendezvous_order(path.encode(), list(order)):
            try:
                r = await self.client.request(method, f"{url}{path}", content=content, headers=headers,
                                              timeout=self.cfg.request_timeout_s)
            except httpx.HTTPError as e:
                order[url].mark_broken(f"{type(e).__name__}: {e}")
                last = f"{url}: {type(e).__name__}: {e}"
                continue
            if r.status_code < 500:
                return _passed(r)
            last = f"{url}: HTTP {r.status_code}"
        return _error(503, f"no backend answered ({last})", "backends_failed", self.cfg.retry_after_s)


def _passed(r: httpx.Response) -> Response:
    headers = {k: v for k, v in r.headers.items() if k.lower() in ("retry-after", "www-authenticate")}
    return Response(r.content, r.status_code, headers, media_type=r.headers.get("content-type"))


def _resume_conflict(opened: httpx.Response | ClientError) -> bool:
    """A 409 `resume_conflict`: the backend will not attach this resume to the request it names."""
    if not isinstance(opened, ClientError) or opened.status != 409:
        return False
    return (_error_of(opened).get("error") or {}).get("code") == "resume_conflict"


def _error_of(error: ClientError) -> dict:
    try:
        body = json.loads(error.content)
        if isinstance(body, dict) and "error" in body:
            return body
    except ValueError:
        pass
    return error_body(error.status, error.content.decode(errors="replace")[:500])


def create_app(cfg: RouterConfig, registry: CollectorRegistry | None = None) -> FastAPI:
    registry = registry or CollectorRegistry()
    router = Router(cfg, registry)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="elastic-ep router", version=__version__, lifespan=lifespan, redoc_url=None,
                  description="OpenAI-compatible gateway over elastic-ep serve instances")
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, f"invalid body: {e.errors()[0]['msg']}", "url"), status_code=400)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        guarded = request.url.path.startswith("/v1/") or (request.url.path == "/backends" and request.method != "GET")
        if guarded and not router.authorized(request):
            return _error(401, "missing or wrong API key: send `Authorization: Bearer <key>`", "invalid_api_key")
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            # by route template, so that a client cannot grow the label set with made-up paths
            route = getattr(request.scope.get("route"), "path", "other")
            router.metrics.requests.labels(route=route, status=str(response.status_code)).inc()
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.generate("completion", "/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.generate("chat", "/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.forward("GET", "/v1/models", request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.forward("POST", "/tokenize", request, await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.forward("POST", "/detokenize", request, await request.body())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        count = len(router.pool.ready())
        reason = "" if count else "no backend is ready"
        return JSONResponse({"ready": bool(count), "reason": reason, "backends_ready": count},
                            status_code=200 if count else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router")
    async def settings() -> dict:
        return {"config": cfg.view(), "backends": [b.view() for b in router.pool.backends.values()],
                "queue_depth": router.admission.waiting}

    @app.get("/backends")
    async def backends() -> list[dict]:
        return [b.view() for b in router.pool.backends.values()]

    @app.post("/backends")
    async def add_backend(body: BackendBody) -> JSONResponse:
        try:
            backend = router.pool.add(body.url, "api")
        except ValueError as e:
            return _error(400, str(e), "invalid_backend")
        await router.pool.poll_once()
        return JSONResponse(backend.view())

    @app.delete("/backends")
    async def remove_backend(body: BackendBody) -> JSONResponse:
        backend = router.pool.remove(body.url)
        if backend is None:
            return _error(404, f"no backend {body.url!r}; GET /backends lists them", "backend_not_found")
        return JSONResponse(backend.view())

    return app
