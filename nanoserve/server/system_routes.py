"""The server's own routes: GET /health (200, or 503 naming why not), GET /metrics (Prometheus), GET /version,
GET /load (requests in flight, with --enable-server-load-tracking; else 0) and GET /v1/models (the served model
names, behind the API key); and what a router asks of a replica besides: vLLM's render routes, POST
/v1/chat/completions/render and POST /v1/completions/render (a request -> the token ids the server would run,
without running it; vllm-router and llm-d tokenize through them to route by prefix)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

import nanoserve
from nanoserve.server.errors import APIError
from nanoserve.server.openai import schema as P
from nanoserve.server.prepare import Prepared, prepare_chat, prepare_completion
from nanoserve.server.routing import Server, check_api_key, json_body, request_body

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


# -- vLLM's render routes: what a prefix-aware router tokenizes through ----------------------------------------------
@router.post("/v1/chat/completions/render", dependencies=[Depends(check_api_key)],
             openapi_extra=request_body(P.ChatCompletionRequest))
async def render_chat(request: Request, server: Server,
                      req: Annotated[P.ChatCompletionRequest, json_body(P.ChatCompletionRequest)]) -> JSONResponse:
    """A chat request -> one GenerateRequest (vLLM's shape): the prompt's token ids after the chat template, the
    sampling parameters; the same checks and 400s as POST /v1/chat/completions."""
    prepared = await server.offload.run(await request.body(), prepare_chat, server, req)
    if prepared.mm_features:  # (a GenerateRequest would carry the features, which this server does not render)
        raise APIError(400, "messages: a chat with images or videos cannot be rendered for a router here",
                       param="messages")
    return JSONResponse(generate_request(f"chatcmpl-{uuid.uuid4().hex}", prepared.prompts[0][1], prepared, req))


@router.post("/v1/completions/render", dependencies=[Depends(check_api_key)],
             openapi_extra=request_body(P.CompletionRequest))
async def render_completion(request: Request, server: Server,
                            req: Annotated[P.CompletionRequest, json_body(P.CompletionRequest)]) -> JSONResponse:
    """A completion request -> one GenerateRequest per prompt (vLLM's shape: a list)."""
    prepared = await server.offload.run(await request.body(), prepare_completion, server, req)
    rid = f"cmpl-{uuid.uuid4().hex}"
    return JSONResponse([generate_request(f"{rid}-{i}", ids, prepared, req)
                         for i, (_, ids) in enumerate(prepared.prompts)])


def generate_request(request_id: str, token_ids: list[int], prepared: Prepared, req: Any) -> dict[str, Any]:
    return {"request_id": request_id, "token_ids": token_ids, "features": None,
            "sampling_params": json_safe(dataclasses.asdict(prepared.params)), "model": prepared.model,
            "stream": bool(req.stream), "stream_options": None, "cache_salt": req.cache_salt,
            "priority": req.priority, "kv_transfer_params": req.kv_transfer_params}


def json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
