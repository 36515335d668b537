"""HTTP errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Every 4xx and 5xx the server sends, from any route, has this body, so OpenAI clients show
the message instead of a parse failure.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
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
