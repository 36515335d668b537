"""The HTTP server of a controller in a group (`serve --etcd`), in front of the real app.

While this controller does not lead (a standby, or a leader whose controller is still starting)
it answers for itself: GET /health and /ping 200 `{"status": "ok", "role": "standby", "reason"}`
(the process is worth keeping), GET /ready 503 (no traffic: a router sends it none), GET /cluster
`{"role", "ready": false, "group"}`, GET /metrics, and every other route, /v1 included, 503 with
`Retry-After` and the leader's URL in `X-Elastic-EP-Leader` and in the message. Once its
controller runs (`lead(app)`), every request goes to that app, which adds `role` and `group` to
/health and /cluster itself (serve/admin.py). `loop()` hands the server's event loop to another
thread (the takeover runs the last leader's requests on there)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from elastic_ep.serve.errors import error_body

RETRY_AFTER_S = 1  # a takeover takes about the lease (2 s by default): ask again soon


class GroupGate:
    """ASGI app: the standby answers above until `lead(app)`. `view()`: the group view
    (group/status.py `group_view`); `reason()`: why this controller takes no requests."""

    def __init__(self, view: Callable[[], dict[str, Any]], reason: Callable[[], str], registry: CollectorRegistry):
        self.view, self.reason, self.registry = view, reason, registry
        self.app: ASGIApp | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving = threading.Event()

    def lead(self, app: ASGIApp) -> None:
        self.app = app

    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this app is served on, once the server called it (its lifespan comes first)."""
        self._serving.wait()
        assert self._loop is not None
        return self._loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._serving.set()
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "lifespan":
            message = await receive()
            while message["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
                message = await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        await self._standby_response(scope)(scope, receive, send)

    def _standby_response(self, scope: Scope) -> Response:
        path, method = scope["path"], scope["method"]
        view, reason = self.view(), self.reason()
        if method in ("GET", "POST") and path in ("/health", "/ping"):
            return JSONResponse({"status": "ok", "reason": reason, "role": view["role"]})
        if method == "GET" and path == "/ready":
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        if method == "GET" and path == "/cluster":
            return JSONResponse({"role": view["role"], "ready": False, "reason": reason, "group": view})
        if method == "GET" and path == "/metrics":
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
        leader = view["leader"]["http"] if view["leader"] and view["role"] == "standby" else ""
        headers = {"Retry-After": str(RETRY_AFTER_S), **({"X-Elastic-EP-Leader": leader} if leader else {})}
        return JSONResponse(error_body(503, f"{reason}: send requests to the leader (or through `elastic-ep "
                                            "router`), or retry here after Retry-After", code="standby"),
                            status_code=503, headers=headers)
