"""The HTTP server of elastic-ep: `create_app(engine, tokenizer, registry=...)`; behind API server
processes (`serve --api-server-count N`) each process runs `create_api_server_app` and the
controller's process `create_engine_app`.

/openapi.json (and its page /docs) describes every route from the models the handlers
validate with (serve/openapi.py). Every error leaves as an OpenAI error body: bad input is a
4xx naming the field (a body that fails validation is a 400, not FastAPI's 422),
`ServiceUnavailable` a 503 with Retry-After, `ScaleRejected` its own status, `ResumeConflict` a
409, any other `ElasticEPError` a 400, and anything unexpected a 500 after which the server keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenizers import Tokenizer

from elastic_ep import __version__
from elastic_ep.control.api import Engine, ResumeConflict, ScaleRejected, ServiceUnavailable
from elastic_ep.errors import ElasticEPError
from elastic_ep.serve.admin import admin_router
from elastic_ep.serve.errors import APIError, error_body, error_response, invalid_body
from elastic_ep.serve.guard import GuardMiddleware, HttpGuard, operating_paths
from elastic_ep.serve.metrics import HttpMetrics, RequestCountMiddleware, route_template
from elastic_ep.serve.openai_api import openai_router
from elastic_ep.serve.openapi import openapi_schema
from elastic_ep.serve.prefix_keys import PrefixKeys
from elastic_ep.serve.proxy import (
    ROUTE_HEADER,
    SERVED_BY_HEADER,
    ForwardedClientMiddleware,
    HeaderMiddleware,
    proxy_router,
)

if TYPE_CHECKING:
    from elastic_ep.serve.remote_engine import RemoteEngine

logger = logging.getLogger(__name__)


def create_app(
    engine: Engine, tokenizer: Tokenizer, *, registry: CollectorRegistry, enable_chaos: bool = False,
    guard: HttpGuard = HttpGuard(), group: Callable[[], dict[str, Any]] | None = None,
) -> FastAPI:
    """The FastAPI app over `engine`. HTTP metrics are registered on `registry`, which
    GET /metrics exports whole (so the engine's own metrics belong there too). `guard`: the
    API keys and the body limit (serve/guard.py), checked before anything else."""
    metrics = HttpMetrics(registry, engine.info.model_name)
    prefix_keys = PrefixKeys()
    return _app([openai_router(engine, tokenizer, metrics, prefix_keys),
                 admin_router(engine, registry, enable_chaos, group, prefix_keys)], metrics, guard)


def create_engine_app(engine: Engine, tokenizer: Tokenizer, *, registry: CollectorRegistry, prefix_keys: PrefixKeys,
                      metrics_dir: Path, enable_chaos: bool = False, guard: HttpGuard = HttpGuard()) -> FastAPI:
    """The controller's own app behind API server processes (`serve --api-server-count N`),
    on a Unix socket they forward to (serve/proxy.py): every route but the OpenAI ones. Its
    /metrics adds the servers' HTTP metrics from `metrics_dir` (prometheus-client's multiprocess
    files), summed over the servers; `prefix_keys`: those the servers were sent. Its /openapi.json
    and /docs, which the servers forward here too, describe the OpenAI routes the servers serve
    as well, so the document is the same as without API servers."""
    MultiProcessCollector(registry, path=str(metrics_dir))
    served_elsewhere = openai_router(engine, tokenizer, HttpMetrics(CollectorRegistry()), prefix_keys)
    app = _app([admin_router(engine, registry, enable_chaos, None, prefix_keys)], None, guard,
               documented=[served_elsewhere])
    # inside ForwardedClientMiddleware, which copies the scope: this one sees the route set on it
    app.add_middleware(HeaderMiddleware, name=ROUTE_HEADER, value=route_template)
    app.add_middleware(ForwardedClientMiddleware)
    return app


def create_api_server_app(engine: RemoteEngine, tokenizer: Tokenizer, *, registry: CollectorRegistry,
                          controller_socket: Path, guard: HttpGuard = HttpGuard()) -> FastAPI:
    """An API server process's app: the OpenAI routes over `engine`, everything else forwarded
    to the controller's app on `controller_socket`. Its HTTP metrics live in the multiprocess
    files the controller's /metrics reads (prometheus-client's PROMETHEUS_MULTIPROC_DIR). Every
    answer names this server in its `x-elastic-ep-api-server` header."""
    metrics = HttpMetrics(registry, engine.info.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()  # its sockets, and its reports to the controller from the start
        yield

    app = _app([openai_router(engine, tokenizer, metrics, engine), proxy_router(controller_socket)], metrics, guard,
               lifespan, docs=False)  # /openapi.json and /docs forwarded: the controller's app documents all
    served_by = str(engine.server)
    app.add_middleware(HeaderMiddleware, name=SERVED_BY_HEADER, value=lambda _: served_by)
    return app


def _app(routers: list[APIRouter], metrics: HttpMetrics | None, guard: HttpGuard, lifespan=None, *,
         documented: list[APIRouter] = (), docs: bool = True) -> FastAPI:
    """`documented`: routers /openapi.json describes that another process serves; `docs` False:
    no /openapi.json nor /docs of its own."""
    app = FastAPI(
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        title="elastic-ep",
        version=__version__,
        description="OpenAI-compatible serving of Mixture-of-Experts models that survives rank faults",
        redoc_url=None,
        # A path that matches no route is a documented 404, not an undocumented 307 to the path
        # without its trailing slash (found by the schema fuzz test: POST /chaos/0%2F).
        redirect_slashes=False,
    )
    disable_created_metrics()  # a `_created` series per counter and histogram: a fifth of all series, unused
    for router in routers:
        app.include_router(router)
    app.add_middleware(InternalErrorMiddleware)
    if metrics is not None:
        app.add_middleware(RequestCountMiddleware, metrics=metrics)
    app.add_middleware(GuardMiddleware, guard=guard,
                       operating=operating_paths([r for router in routers for r in router.routes]))
    _add_error_handlers(app)
    elsewhere = [route for router in documented for route in router.routes]
    app.openapi = lambda: openapi_schema(app, elsewhere)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(invalid_body(e.errors()))

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(ServiceUnavailable)
    async def unavailable(_: Request, e: ServiceUnavailable) -> JSONResponse:
        headers = {"Retry-After": str(e.retry_after_s)}
        return error_response(APIError(503, str(e), code="service_unavailable", headers=headers))

    @app.exception_handler(ScaleRejected)
    async def scale_rejected(_: Request, e: ScaleRejected) -> JSONResponse:
        return error_response(APIError(e.status, str(e), param=e.param, code="scale_rejected"))

    @app.exception_handler(ResumeConflict)
    async def resume_conflict(_: Request, e: ResumeConflict) -> JSONResponse:
        return error_response(APIError(409, str(e), param=e.param, code="resume_conflict"))

    @app.exception_handler(ElasticEPError)
    async def user_error(_: Request, e: ElasticEPError) -> JSONResponse:
        return error_response(APIError(400, str(e)))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail), headers=e.headers))


class InternalErrorMiddleware:
    """Any unexpected exception becomes one logged 500 with an OpenAI error body, and the
    server keeps serving (Starlette's own handler would also re-raise it to uvicorn)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as e:
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started or scope["type"] != "http":
                return
            response = JSONResponse(
                error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500
            )
            await response(scope, receive, send)
