"""The server's own routes: GET /health (200, or 503 naming why not), GET /metrics (Prometheus), GET /version,
GET /load (requests in flight, with --enable-server-load-tracking; else 0) and GET /v1/models (the served model
names, behind the API key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

import nanoserve
from nanoserve.server.errors import APIError
from nanoserve.server.openai import schema as P
from nanoserve.server.routing import Server, check_api_key

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(check_api_key)])
async def list_models(server: Server) -> JSONResponse:
    cards = [P.ModelCard(id=name, root=server.engine.config.model, max_model_len=server.max_model_len)
             for name in server.model_names]
    return JSONResponse(P.ModelList(data=cards).model_dump())


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": nanoserve.__version__})


@router.get("/load")
async def load(server: Server) -> JSONResponse:
    """Generation requests in flight (vLLM's server_load; 0 unless --enable-server-load-tracking)."""
    return JSONResponse({"server_load": server.server_load})


@router.get("/health")
async def health(server: Server) -> Response:
    engine = server.engine
    life = server.lifecycle
    if life is not None and life.draining and life.dead_reason is None:
        return APIError(503, "the server is shutting down").response()
    if engine.dead_error is not None:
        return APIError(503, f"the engine has stopped after an error: {engine.dead_error}").response()
    if not engine.is_running:
        return APIError(503, "the engine loop is not running").response()
    try:
        # reads worker state only (no collective): a tensor-parallel worker that died while the server was
        # idle shows here before any request trips over it
        engine.engine.executor.check_health()
    except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
        return APIError(503, f"the engine is unhealthy: {exc}").response()
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(server: Server) -> Response:
    body, content_type = server.metrics.render(server.engine.snapshot)
    return Response(body, media_type=content_type)
