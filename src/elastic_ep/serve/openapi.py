"""/openapi.json: FastAPI's schema of every route, from the pydantic models the handlers
validate with, plus what FastAPI cannot see by itself:

- the error responses each route really sends (`error_responses`), all in OpenAI's shape;
- the server-sent events of `stream: true` (`event_stream_response`), whose event models are
  added to the components;
- no 422: a body that fails validation is answered with 400 (serve/app.py), so FastAPI's
  default 422 entry and its ValidationError schemas are dropped;
- the guard's answers (serve/guard.py): the bearer keys as security schemes, 401 on `/v1`,
  401 / 403 on the operating routes, 411 / 413 on every route that takes a body.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute

from elastic_ep.serve.guard import OPERATING
from elastic_ep.serve.protocol import ChatCompletionStreamResponse, CompletionStreamResponse, ErrorResponse

_REF = "#/components/schemas/{model}"
_STREAM_EVENT_MODELS = (CompletionStreamResponse, ChatCompletionStreamResponse)
_ERROR_DESCRIPTIONS = {
    400: "Invalid request; `error.param` names the field",
    401: "No valid key in `Authorization: Bearer <key>` (--api-key; --admin-api-key on operating routes)",
    403: "An operating route: a key other than --admin-api-key, or a client not on loopback while the server "
         "has no admin key",
    404: "Unknown model, route or action",
    409: "Conflicts with an operation in progress",
    411: "A body without Content-Length (chunked bodies are not taken)",
    413: "The body is over --max-request-body-bytes",
    500: "Internal error; the server keeps serving",
    503: "Cannot take the request now; retry after `Retry-After` seconds",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entries of a route for the error statuses it may send."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        responses[status] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        if status == 503:
            responses[status]["headers"] = {
                "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}
            }
    return responses


def event_stream_response(event: type[BaseModel]) -> dict[str, Any]:
    """A 200 answered with server-sent events when the body says `stream: true`: each event
    is `data: <event JSON>`, an error `data: <ErrorResponse JSON>`, the last `data: [DONE]`."""
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"$ref": _REF.format(model=event.__name__)},
    }
    return {
        "description": f"JSON, or with `stream: true` server-sent events of {event.__name__} "
                       "ending with `data: [DONE]`",
        "content": {
            "text/event-stream": {
                "itemSchema": {"type": "object", "properties": {"data": data}, "required": ["data"]}
            }
        },
    }


def openapi_schema(app: FastAPI, served_elsewhere: list[BaseRoute] = ()) -> dict[str, Any]:
    """The app's OpenAPI document (built once); use as `app.openapi = lambda: openapi_schema(app)`.
    `served_elsewhere`: routes another process serves for the same API (`serve --api-server-count`)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description,
            routes=[*served_elsewhere, *app.routes],
        )
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                _add_guard(path, operation)
        schema["components"]["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "--api-key, needed on /v1 when set"},
            "adminKey": {"type": "http", "scheme": "bearer",
                         "description": "--admin-api-key, needed on the operating routes when set"},
        }
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        _, events = models_json_schema(
            [(m, "serialization") for m in _STREAM_EVENT_MODELS], ref_template=_REF
        )
        components.update(events["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


def _add_guard(path: str, operation: dict[str, Any]) -> None:
    """The security and the error responses of serve/guard.py on one operation."""
    statuses: list[int] = []
    if path == "/v1" or path.startswith("/v1/"):
        operation["security"] = [{"apiKey": []}, {}]  # {}: a server started without --api-key
        statuses.append(401)
    if OPERATING in operation.get("tags", []):
        operation["security"] = [{"adminKey": []}, {}]
        statuses += [401, 403]
    if "requestBody" in operation:
        statuses += [411, 413]
    for status in statuses:
        operation["responses"][str(status)] = {
            "description": _ERROR_DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=ErrorResponse.__name__)}}},
        }
