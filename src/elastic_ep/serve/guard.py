"""Who may call what on the HTTP API, and how much a client may make the server hold.

As vLLM guards its API: with `--api-key` (or $ELASTIC_EP_API_KEY) every `/v1/*` request needs
`Authorization: Bearer <key>` (401 otherwise). The operating routes (those tagged `operating`:
scale, the expert recorder, chaos, and whatever is tagged so later) need `--admin-api-key` when
one is set (401 without a key, 403 with another), and are refused (403) to clients that are not
on loopback when none is set. `/health`, `/ready`, `/metrics` and the read-only views stay open
for probes. The admin key is also taken on `/v1`.

Bodies: a request declaring more than `max_request_body_bytes` is answered 413 before its body
is read, and a body without a length (chunked) 411, so no body is held beyond the limit.
Slow clients: `request_timeout_protocol` closes a connection that has not sent a whole request
(headers and body) within `request_timeout_s` of connecting or of its last response.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass

import h11
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from elastic_ep.serve.errors import error_body

OPERATING = "operating"  # the OpenAPI tag of the routes that change or inspect the deployment's operation
API_KEY_ENV = "ELASTIC_EP_API_KEY"
ADMIN_API_KEY_ENV = "ELASTIC_EP_ADMIN_API_KEY"
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HttpGuard:
    """api_key: needed on /v1 (None: open); admin_api_key: needed on the operating routes (None:
    loopback clients only); max_request_body_bytes: larger bodies get 413."""

    api_key: str | None = None
    admin_api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _matches(token: str | None, *keys: str | None) -> bool:
    return token is not None and any(k is not None and hmac.compare_digest(token.encode(), k.encode()) for k in keys)


def _on_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    try:
        return client is not None and ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k == name), None)


class GuardMiddleware:
    """Pure ASGI, outermost: refuses before the app reads anything. `operating(path)`: whether
    a path is an operating route's."""

    def __init__(self, app: ASGIApp, guard: HttpGuard, operating: Callable[[str], bool]):
        self.app = app
        self.guard = guard
        self.operating = operating

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, code = refusal
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        await JSONResponse(error_body(status, message, code=code), status_code=status, headers=headers)(
            scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        g = self.guard
        path = scope["path"]
        token = _bearer(scope)
        if path == "/v1" or path.startswith("/v1/"):
            if g.api_key is not None and not _matches(token, g.api_key, g.admin_api_key):
                return 401, "a valid API key is needed: send `Authorization: Bearer <key>` (--api-key)", \
                    "invalid_api_key"
        elif self.operating(path):
            if g.admin_api_key is not None:
                if token is None:
                    return 401, "this operating route needs the admin key: send `Authorization: Bearer <key>` " \
                        "(--admin-api-key)", "invalid_api_key"
                if not _matches(token, g.admin_api_key):
                    return 403, "this key may not use the operating routes; they take the --admin-api-key", \
                        "forbidden"
            elif not _on_loopback(scope):
                return 403, "operating routes answer loopback clients only while the server has no " \
                    "--admin-api-key; start it with one to reach them from other hosts", "forbidden"
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                too_large = int(length) > g.max_request_body_bytes
            except ValueError:
                return 400, "Content-Length is not a number", "invalid_request"
            if too_large:
                return 413, f"the request body is over {g.max_request_body_bytes} bytes " \
                    "(--max-request-body-bytes)", "request_too_large"
        elif _header(scope, b"transfer-encoding") is not None:
            return 411, "send the body with a Content-Length (chunked bodies are not taken)", "length_required"
        return None


def operating_paths(routes) -> Callable[[str], bool]:
    """A predicate for the paths of the routes tagged `operating` among `routes` (the routers' APIRoutes)."""
    patterns: list[re.Pattern] = [r.path_regex for r in routes if OPERATING in (getattr(r, "tags", None) or [])]
    return lambda path: any(p.match(path) for p in patterns)


def request_timeout_protocol(request_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request within
    `request_timeout_s` of connecting or of its last response (a client that connects and
    sends nothing, or trickles its headers or body, holds a connection no longer than that)."""

    class RequestTimeoutH11(H11Protocol):
        _request_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._request_timer = self.loop.call_later(request_timeout_s, self._cut)

        def _disarm(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _cut(self) -> None:
            self._request_timer = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return RequestTimeoutH11
