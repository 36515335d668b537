"""Operator routes: liveness and readiness, Prometheus metrics, the cluster view and its
dashboard, online scaling, the expert distribution recorder (SGLang's paths) and fault
injection (only when served with --enable-chaos).

Engine calls here are synchronous and run on the server's event loop: the engine answers
them from its own state without waiting on ranks.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from elastic_ep.control.api import CHAOS_ACTIONS, ChaosOrder, Engine
from elastic_ep.serve.errors import APIError, bad_request
from elastic_ep.serve.protocol import ChaosRequest, ScaleRequest, parse_body

DASHBOARD_HTML = Path(__file__).parent / "static" / "dashboard.html"


def admin_router(engine: Engine, registry: CollectorRegistry, enable_chaos: bool) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @router.get("/ready")
    async def ready() -> JSONResponse:
        readiness = engine.readiness()
        body = {"ready": readiness.ready, "reason": readiness.reason}
        return JSONResponse(body, status_code=200 if readiness.ready else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/cluster")
    async def cluster(
        events: int = Query(50, ge=0, description="the last N events (0: all kept, up to 1000)"),
        since: int | None = Query(None, ge=0, description="only events with an id above this"),
    ) -> dict:
        return engine.cluster(since, events or None)

    @router.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @router.get("/dashboard")
    async def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD_HTML, media_type="text/html")

    @router.post("/scale_elastic_ep")
    async def scale(request: Request) -> dict:
        body = parse_body(await request.body(), ScaleRequest)
        if body.new_ep_size < 1:
            raise bad_request(f"new_ep_size must be >= 1, got {body.new_ep_size}", "new_ep_size")
        return await engine.scale(body.new_ep_size)

    @router.get("/is_scaling_elastic_ep")
    async def is_scaling() -> dict:
        return engine.scale_status()

    @router.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
    async def start_record() -> dict:
        engine.start_expert_distribution_record()
        return {"status": "recording"}

    @router.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
    async def stop_record() -> dict:
        engine.stop_expert_distribution_record()
        return {"status": "stopped"}

    @router.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
    async def dump_record() -> dict:
        return engine.dump_expert_distribution_record()

    @router.post("/chaos/{action}")
    async def chaos(action: str, request: Request) -> dict:
        if not enable_chaos:
            raise APIError(
                404,
                "fault injection is off on this server; restart it with `elastic-ep serve --enable-chaos`",
                code="chaos_disabled",
            )
        if action not in CHAOS_ACTIONS:
            raise APIError(404, f"unknown chaos action {action!r}; use one of {', '.join(CHAOS_ACTIONS)}")
        body = parse_body(await request.body(), ChaosRequest)
        if not body.delay_s >= 0:
            raise bad_request(f"delay_s must be >= 0, got {body.delay_s}", "delay_s")
        return engine.chaos(ChaosOrder(action, body.rank_id, body.delay_s, body.layer, body.slot, body.at_next_epoch))

    return router
