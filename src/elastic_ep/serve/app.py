"""The HTTP server of elastic-ep: `create_app(engine, tokenizer, registry=...)`.

/openapi.json (and its page /docs) describes every route from the models the handlers
validate with (serve/openapi.py). Every error leaves as an OpenAI error body: bad input is a
4xx naming the field (a body that fails validation is a 400, not FastAPI's 422),
`ServiceUnavailable` a 503 with Retry-After, `ScaleRejected` its own status, `ResumeConflict` a
409, any other `ElasticEPError` a 400, and anything unexpected a 500 after which the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, disable_created_metrics
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenizers import Tokenizer

from elastic_ep import __version__
from elastic_ep.control.api import Engine, ResumeConflict, ScaleRejected, ServiceUnavailable
from elastic_ep.errors import ElasticEPError
from elastic_ep.serve.admin import admin_router
from elastic_ep.serve.errors import APIError, error_body, error_response, invalid_body
from elastic_ep.serve.guard import GuardMiddleware, HttpGuard, operating_paths
from elastic_ep.serve.metrics import HttpMetrics, RequestCountMiddleware
from elastic_ep.serve.openai_api import openai_router
from elastic_ep.serve.openapi import openapi_schema
from elastic_ep.serve.prefix_keys import PrefixKeys

logger = logging.getLogger(__name__)


def create_app(
    engine: Engine, tokenizer: Tokenizer, *, registry: CollectorRegistry, enable_chaos: bool = False,
    guard: HttpGuard = HttpGuard(), group: Callable[[], dict[str, Any]] | None = None,
) -> FastAPI:
    """The FastAPI app over `engine`. HTTP metrics are registered on `registry`, which
    GET /metrics exports whole (so the engine's own metrics belong there too). `guard`: the
    API keys and the body limit (serve/guard.py), checked before anything else."""
    app = FastAPI(
        title="elastic-ep",
        version=__version__,
        description="OpenAI-compatible serving of Mixture-of-Experts models that survives rank faults",
        redoc_url=None,
        # A path that matches no route is a documented 404, not an undocumented 307 to the path
        # without its trailing slash (found by the schema fuzz test: POST /chaos/0%2F).
        redirect_slashes=False,
    )
    disable_created_metrics()  # a `_created` series per counter and histogram: a fifth of all series, unused
    metrics = HttpMetrics(registry, engine.info.model_name)
    prefix_keys = PrefixKeys()
    routers = [openai_router(engine, tokenizer, metrics, prefix_keys),
               admin_router(engine, registry, enable_chaos, group, prefix_keys)]
    for router in routers:
        app.include_router(router)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(RequestCountMiddleware, metrics=metrics)
    app.add_middleware(GuardMiddleware, guard=guard,
                       operating=operating_paths([r for router in routers for r in router.routes]))
    _add_error_handlers(app)
    app.openapi = lambda: openapi_schema(app)
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
