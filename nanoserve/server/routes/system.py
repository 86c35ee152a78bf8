"""The server's own routes: GET /health (200, or 503 naming why not), GET /metrics (Prometheus), and
GET /v1/models (the one served model, behind the API key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from nanoserve.server import protocol as P
from nanoserve.server.errors import APIError
from nanoserve.server.routes.common import Server, check_api_key

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(check_api_key)])
async def list_models(server: Server) -> JSONResponse:
    card = P.ModelCard(id=server.model_name, root=server.engine.config.model, max_model_len=server.max_model_len)
    return JSONResponse(P.ModelList(data=[card]).model_dump())


@router.get("/health")
async def health(server: Server) -> Response:
    engine = server.engine
    if engine.dead_error is not None:
        return APIError(503, f"the engine has stopped after an error: {engine.dead_error}",
                        code="engine_dead").response()
    if not engine.is_running:
        return APIError(503, "the engine loop is not running", code="engine_not_running").response()
    try:
        # reads worker state only (no collective): a tensor-parallel worker that died while the server was
        # idle shows here before any request trips over it
        engine.engine.executor.check_health()
    except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
        return APIError(503, f"the engine is unhealthy: {exc}", code="engine_dead").response()
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(server: Server) -> Response:
    body, content_type = server.metrics.render(server.engine.snapshot)
    return Response(body, media_type=content_type)
