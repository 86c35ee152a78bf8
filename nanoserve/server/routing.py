"""What every API's routes use: `Server` (the shared ServerState, as a dependency), `v1_router` (the /v1 prefix
behind the API-key check), and `json_body` / `request_body` (parse a body strictly, and describe it in
/openapi.json).

Bodies are parsed by pydantic straight from the bytes (body_parser.py: model_validate_json, a large body in a
worker process) rather than by FastAPI's body parameter: that keeps JSON-mode strict parsing and lets
describe_validation_error name the field. A body sent with a Content-Type other than application/json gets vLLM's
answer (400, "Unsupported Media Type"). `request_body` puts the same model's schema into the OpenAPI document, so
the API's description still shows every field.
"""

from __future__ import annotations

import hmac
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from nanoserve.server.errors import APIError, describe_validation_error
from nanoserve.server.schema_base import RequestBody
from nanoserve.server.state import ServerState

logger = logging.getLogger(__name__)


def get_server(request: Request) -> ServerState:
    return request.app.state.server


Server = Annotated[ServerState, Depends(get_server)]


async def check_api_key(request: Request, server: Server) -> None:
    """401 unless the Bearer token - or the x-api-key header, which Anthropic's clients send - matches --api-key
    (when one is set)."""
    if server.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        token = request.headers.get("x-api-key", "")
    if not token:
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
    if not hmac.compare_digest(token.strip().encode(), server.api_key.encode()):
        raise APIError(401, "invalid API key")


def v1_router() -> APIRouter:
    """A router for the OpenAI API: under /v1, behind the API key."""
    return APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


def check_json_content_type(request: Request) -> None:
    """A 400 unless the body is declared as JSON (parameters such as charset are fine), as vLLM answers."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(400, UNSUPPORTED_MEDIA_TYPE)


def json_body(model: type[RequestBody]) -> Any:
    """A dependency giving the request body parsed as `model`; a bad body is a 400 naming the field. Use it as
    `req: Annotated[Model, json_body(Model)]`."""
    async def parse(request: Request) -> RequestBody:
        check_json_content_type(request)
        body = await request.body()
        server = get_server(request)
        try:  # a large body is parsed off the event loop, in a worker process (body_parser.py)
            req = await server.parser.parse(model, body, server.prompt_chars_limit)
        except ValidationError as exc:
            raise describe_validation_error(exc) from exc
        log_ignored_fields(req)
        return req

    return Depends(parse)


def log_ignored_fields(req: RequestBody) -> None:
    """Fields the API does not have are ignored (clients send `store`, `metadata`, ...), and logged, as vLLM does."""
    if req.ignored_fields:
        logger.warning("The following fields were present in the request but ignored: %s", list(req.ignored_fields))


def request_body(model: type[RequestBody]) -> dict[str, Any]:
    """`openapi_extra` for a route whose body json_body parses: `model`'s JSON schema as the request body (nested
    models inlined, so the schema is complete where it stands)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**inline(defs[node["$ref"].rsplit("/", 1)[-1]]), **inline(rest)}
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
