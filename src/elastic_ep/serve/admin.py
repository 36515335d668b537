"""Operator routes: liveness (/health, and /ping as vLLM names it) and readiness, /version,
Prometheus metrics, the cluster view and its dashboard, online scaling, drain and uncordon, rolling
restart, sleep and wake (vLLM's paths), the expert distribution recorder (SGLang's paths) and fault injection
(only when served with --enable-chaos). The routes tagged `operating` are guarded by the admin
key (serve/guard.py).

Engine calls here are synchronous and run on the server's event loop: the engine answers
them from its own state without waiting on ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from elastic_ep import __version__
from elastic_ep.control.api import CHAOS_ACTIONS, ChaosOrder, Engine
from elastic_ep.serve.errors import APIError
from elastic_ep.serve.guard import OPERATING
from elastic_ep.serve.openapi import error_responses
from elastic_ep.serve.prefix_keys import PrefixKeys, PrefixKeysResponse
from elastic_ep.serve.protocol import (
    ChaosRequest,
    DrainRequest,
    DrainResponse,
    HealthResponse,
    ReadyResponse,
    RecorderResponse,
    RollingRestartRequest,
    ScaleRequest,
    ScaleResponse,
    UncordonRequest,
    UncordonResponse,
    VersionResponse,
)

DASHBOARD_HTML = Path(__file__).parent / "static" / "dashboard.html"
DEAD = {503: {"model": HealthResponse, "description": "The engine stopped; restart the server"}}


def admin_router(engine: Engine, registry: CollectorRegistry, enable_chaos: bool,
                 group: Callable[[], dict[str, Any]] | None = None,
                 prefix_keys: PrefixKeys | None = None) -> APIRouter:
    """`group`: in a controller group (serve --etcd), the group view (group/status.py), which /cluster
    carries as `group` and whose `role` /health gives; `prefix_keys`: the routers' keys this
    instance was sent, which GET /prefix_keys lists."""
    router = APIRouter(responses=error_responses(500))

    @router.get(
        "/health",
        response_model=HealthResponse,
        responses=DEAD,
    )
    async def health() -> JSONResponse:
        """200 while the engine runs ("ok", or "degraded" with the reason: a restart would not help),
        503 once it stopped ("dead"). Readiness to take traffic is GET /ready."""
        h = engine.health()
        body = HealthResponse(status=h.status, reason=h.reason, role=group()["role"] if group else None)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=503 if h.status == "dead" else 200)

    @router.get("/ping", response_model=HealthResponse, responses=DEAD)
    @router.post("/ping", response_model=HealthResponse, responses=DEAD)
    async def ping() -> JSONResponse:
        """vLLM's (and SageMaker's) name for GET /health, by GET or POST: the same answer."""
        return await health()

    @router.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        """This server's version, as vLLM's /version."""
        return VersionResponse(version=__version__)

    @router.get(
        "/ready",
        response_model=ReadyResponse,
        responses={503: {"model": ReadyResponse, "description": "Not ready; `reason` says why"}},
    )
    async def ready() -> JSONResponse:
        readiness = engine.readiness()
        body = ReadyResponse(ready=readiness.ready, reason=readiness.reason)
        return JSONResponse(body.model_dump(), status_code=200 if readiness.ready else 503)

    @router.get(
        "/metrics", response_class=Response, responses=_text_response("text/plain", "Prometheus text")
    )
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/cluster", response_model=dict[str, Any])
    async def cluster(
        events: int = Query(50, ge=0, description="the last N events (0: all kept, up to 1000)"),
        since: int | None = Query(None, ge=0, description="only events with an id above this"),
    ) -> dict[str, Any]:
        """The cluster view; its fields are documented on `Engine.cluster` (control/api.py)."""
        view = engine.cluster(since, events or None)
        return {**view, "role": "leader", "group": group()} if group else view

    keys = prefix_keys or PrefixKeys()

    @router.get("/prefix_keys", response_model=PrefixKeysResponse)
    async def prefix_keys_seen() -> PrefixKeysResponse:
        """The routers' prefix keys this instance was sent (X-Elastic-EP-Prefix-Key), with the
        requests of each and the age of the last: what routers read to place prefixes alike
        (serve/prefix_keys.py)."""
        return PrefixKeysResponse(keys=keys.view(), capacity=keys.capacity)

    @router.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @router.get("/dashboard", response_class=Response, responses=_text_response("text/html", "The dashboard"))
    async def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD_HTML, media_type="text/html")

    @router.post("/scale_elastic_ep", response_model=ScaleResponse, responses=error_responses(400, 409),
                 tags=[OPERATING])
    async def scale(body: ScaleRequest) -> dict[str, Any]:
        return await engine.scale(body.new_ep_size, body.ranks)

    @router.post("/drain", response_model=DrainResponse, responses=error_responses(400, 409), tags=[OPERATING])
    async def drain(body: DrainRequest) -> dict[str, Any]:
        """Retire `ranks`, or cordon `node` and retire its ranks, in the background: experts only they
        hold move off, their requests finish or move, then they stop. Progress in
        GET /is_scaling_elastic_ep; each rank's `safe_to_terminate` in GET /cluster."""
        return await engine.drain(body.ranks, body.node)

    @router.post("/uncordon", response_model=UncordonResponse, responses=error_responses(400, 409),
                 tags=[OPERATING])
    async def uncordon(body: UncordonRequest) -> dict[str, Any]:
        """New ranks (a scale-up, a standby, a registering agent) may start on `node` again."""
        return await engine.uncordon(body.node)

    @router.post("/rolling_restart", response_model=dict[str, Any], responses=error_responses(400, 409),
                 tags=[OPERATING])
    async def rolling_restart(body: RollingRestartRequest | None = None) -> dict[str, Any]:
        """Replace every worker process, one rank at a time, by one started with the options given
        (and the elastic-ep installed now): drain, stop, start, rejoin; a standby takes a rank's place
        first when there is one. In the background: progress in GET /rolling_restart and /cluster."""
        options = (body or RollingRestartRequest()).model_dump(exclude_none=True)
        if "model" in options:
            options["model_dir"] = os.path.abspath(options.pop("model"))
        return await engine.rolling_restart(options)

    @router.post("/rolling_restart/abort", response_model=dict[str, Any], responses=error_responses(409),
                 tags=[OPERATING])
    async def abort_rolling_restart() -> dict[str, Any]:
        """The rank in flight finishes (its replacement serves); no other rank is replaced."""
        return await engine.abort_rolling_restart()

    @router.get("/rolling_restart", response_model=dict[str, Any])
    async def rolling_restart_status() -> dict[str, Any]:
        """The rollout's progress (guarded as its path is; /cluster's `rollout` is the same, open)."""
        return engine.rolling_restart_status()

    @router.get("/is_scaling_elastic_ep", response_model=dict[str, Any])
    async def is_scaling() -> dict[str, Any]:
        return engine.scale_status()

    @router.post("/sleep", response_model=dict[str, Any], responses=error_responses(400, 409), tags=[OPERATING])
    async def sleep(
        level: int = Query(1, description="1: free the KV cache; 2: drop the weights too"),
    ) -> dict[str, Any]:
        """Give memory back while idle (every rank); requests get 503 until POST /wake_up. The
        answer has each rank's resident memory before and after."""
        return await engine.sleep(level)

    @router.post("/wake_up", response_model=dict[str, Any], responses=error_responses(409), tags=[OPERATING])
    async def wake_up() -> dict[str, Any]:
        return await engine.wake_up()

    @router.get("/is_sleeping", response_model=dict[str, Any])
    async def is_sleeping() -> dict[str, Any]:
        return engine.is_sleeping()

    @router.get("/start_expert_distribution_record", response_model=RecorderResponse, tags=[OPERATING])
    @router.post("/start_expert_distribution_record", response_model=RecorderResponse, tags=[OPERATING])
    async def start_record() -> RecorderResponse:
        engine.start_expert_distribution_record()
        return RecorderResponse(status="recording")

    @router.get("/stop_expert_distribution_record", response_model=RecorderResponse, tags=[OPERATING])
    @router.post("/stop_expert_distribution_record", response_model=RecorderResponse, tags=[OPERATING])
    async def stop_record() -> RecorderResponse:
        engine.stop_expert_distribution_record()
        return RecorderResponse(status="stopped")

    @router.get("/dump_expert_distribution_record", response_model=dict[str, Any], tags=[OPERATING])
    @router.post("/dump_expert_distribution_record", response_model=dict[str, Any], tags=[OPERATING])
    async def dump_record() -> dict[str, Any]:
        return engine.dump_expert_distribution_record()

    @router.post("/chaos/{action}", response_model=dict[str, Any], responses=error_responses(400, 404),
                 tags=[OPERATING])
    async def chaos(action: str, body: ChaosRequest) -> dict[str, Any]:
        if not enable_chaos:
            raise APIError(
                404,
                "fault injection is off on this server; restart it with `elastic-ep serve --enable-chaos`",
                code="chaos_disabled",
            )
        if action not in CHAOS_ACTIONS:
            raise APIError(404, f"unknown chaos action {action!r}; use one of {', '.join(CHAOS_ACTIONS)}")
        if action == "poison" and not body.request_id and body.rank_id is None:
            raise APIError(400, "poison needs request_id (the id of a running request: its chunks' `id`) or "
                           "rank_id (every step of that rank raises)", param="request_id")
        if action in ("cut", "heal") and (body.rank_id is None) == (body.node is None):
            raise APIError(400, f"{action} needs rank_id (a rank) or node (a whole node), not both", param="rank_id")
        if action not in ("poison", "cut", "heal") and body.rank_id is None:
            raise APIError(400, f"{action} needs rank_id: a rank listed by GET /cluster", param="rank_id")
        return engine.chaos(ChaosOrder(action, body.rank_id if body.rank_id is not None else -1, body.delay_s,
                                       body.layer, body.slot, body.at_next_epoch, body.request_id, body.phase,
                                       body.node, body.duration_s))

    return router


def _text_response(media_type: str, description: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}}
