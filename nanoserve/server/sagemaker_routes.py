"""SageMaker's two routes, as vLLM serves them: GET/POST /ping (the health check) and POST /invocations (a chat
or a completion body, told apart by which request model it parses as - chat first)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from nanoserve.server.errors import APIError
from nanoserve.server.openai.routes import chat, complete
from nanoserve.server.openai.schema import ChatCompletionRequest, CompletionRequest
from nanoserve.server.routing import Server, check_json_content_type, request_body
from nanoserve.server.system_routes import health

router = APIRouter()

INVOCATION_TYPES = [(ChatCompletionRequest, chat), (CompletionRequest, complete)]  # tried in this order


@router.get("/ping")
@router.post("/ping")
async def ping(server: Server) -> Response:
    """SageMaker's health check: /health's answer."""
    return await health(server)


def _invocations_body() -> dict:
    """Either request body's schema (request_body inlines each one's definitions)."""
    variants = [request_body(model)["requestBody"]["content"]["application/json"]["schema"]
                for model, _ in INVOCATION_TYPES]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": variants}}}}}


@router.post("/invocations", openapi_extra=_invocations_body())
async def invocations(request: Request, server: Server) -> Response:
    check_json_content_type(request)
    body = await request.body()
    for model, handler in INVOCATION_TYPES:
        try:  # a large body in a worker process (body_parser.py)
            req = await server.parser.parse(model, body, server.prompt_chars_limit)
        except ValidationError:
            continue
        return await handler(request, server, req)
    names = [model.__name__ for model, _ in INVOCATION_TYPES]
    raise APIError(400, f"Cannot find suitable handler for request. Expected one of: {names}")
