"""HTTP errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Every 4xx and 5xx the server sends, from any route, has this body, so OpenAI clients show
the message instead of a parse failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A request the server answers with `status` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    error_type = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code), status_code=err.status, headers=err.headers
    )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def invalid_body(errors: Sequence[Any]) -> APIError:
    """The 400 for a body that failed validation (FastAPI's RequestValidationError errors,
    pydantic's shape): it names the field and what was wrong with it.

    A union field (prompt, stop) fails once per form it may take; an error about a value
    (a range, a finite number) is the one to report, since its form matched."""
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    path = [str(p) for p in first["loc"] if p != "body" and not _is_union_branch(p)]
    param = ".".join(path) or None
    if first["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    if param is None:
        if first["type"] == "missing":
            return bad_request("the request body is empty; send a JSON object")
        return bad_request(f"the request body must be a JSON object: {first['msg']}")
    if first["type"] == "extra_forbidden":
        return bad_request(
            f"{param!r} is not supported by elastic-ep; remove it (/openapi.json lists every field)", param
        )
    if first["type"] == "missing":
        return bad_request(f"field {param!r} is required", param)
    return bad_request(f"invalid field {param!r}: {first['msg']} (got {first.get('input')!r:.80})", param)


def _is_union_branch(part: object) -> bool:
    """pydantic names the union member it tried (`prompt.str`, `stop.list[str]`, the
    tokenize request's `chat` / `completion` tag) in the location; the user needs the field."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "chat", "completion")
        or "[" in part
        or part.startswith("constrained")
    )
