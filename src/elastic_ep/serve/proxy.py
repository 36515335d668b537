"""What an API server process does not serve itself it forwards to the controller's app
(`serve --api-server-count N`): every route but the OpenAI ones (/cluster, /metrics, /health,
/ready, the dashboard, scale, drain, chaos, ...), so each answers as one server would, whichever
process took the connection.

The controller's app listens on a Unix socket in the deployment's private directory (mode
0700), so only this user's processes reach it. The client's address travels in `CLIENT_HEADER`,
set here over whatever a client sent: the controller's guard judges loopback by it
(`ForwardedClientMiddleware`), and nothing outside that directory can set it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from fastapi import APIRouter, Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elastic_ep.serve.errors import APIError, error_response
from elastic_ep.serve.metrics import ROUTED_AS

CLIENT_HEADER = "x-elastic-ep-forwarded-client"
SERVED_BY_HEADER = "x-elastic-ep-api-server"
# the controller's app names the route that answered (its template), for the server's request metrics
ROUTE_HEADER = "x-elastic-ep-route"
# hop-by-hop headers (RFC 9110 7.6.1) and what the forwarding itself sets again
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
        CLIENT_HEADER, ROUTE_HEADER}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def proxy_router(socket_path: Path) -> APIRouter:
    """A router that forwards every request it matches to the app on `socket_path`; include it
    after the routes served here."""
    client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
                               base_url="http://controller", timeout=None)
    router = APIRouter()

    async def forward(request: Request) -> Response:
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _HOP]
        headers.append((CLIENT_HEADER.encode(), (request.client.host if request.client else "").encode()))
        target = request.scope.get("raw_path") or request.url.path.encode()
        if request.url.query:
            target += b"?" + request.url.query.encode()
        sent = client.build_request(request.method, target.decode("latin-1"), headers=headers,
                                    content=await request.body())
        request.scope[ROUTED_AS] = "other"
        try:
            answer = await client.send(sent, stream=True)
        except httpx.TransportError as e:
            return error_response(APIError(503, f"the controller's process does not answer ({e}); it may be "
                                           "stopping", code="service_unavailable", headers={"Retry-After": "5"}))
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP and k.lower() != SERVED_BY_HEADER}
        request.scope[ROUTED_AS] = answer.headers.get(ROUTE_HEADER, "other")  # not the catch-all's template
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=kept,
                                 background=BackgroundTask(answer.aclose))

    router.add_api_route("/{path:path}", forward, methods=METHODS, include_in_schema=False)
    return router


class HeaderMiddleware:
    """Adds header `name` to every answer, with `value(scope)` read as the answer starts (None:
    not added). Used twice behind API servers: the controller's app names the route that took
    a request in `ROUTE_HEADER` (its path template, as the request metrics label it), so the
    forwarding server counts /cluster as /cluster and not as the forwarding route; each API
    server names itself in `SERVED_BY_HEADER`, for whoever traces a request through the N."""

    def __init__(self, app: ASGIApp, name: str, value: Callable[[Scope], str | None]):
        self.app = app
        self.name = name.encode()
        self.value = value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start" and (value := self.value(scope)):
                message = {**message, "headers": [*message.get("headers", ()), (self.name, value.encode())]}
            await send(message)

        await self.app(scope, receive, send_named)


class ForwardedClientMiddleware:
    """On the controller's app behind API servers: the client is the one `CLIENT_HEADER` names
    (the API server's proxy set it), so the guard's loopback rule judges the real client."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == CLIENT_HEADER.encode()),
                        None)
            if host is not None:
                scope = {**scope, "client": (host, 0)}
        await self.app(scope, receive, send)
