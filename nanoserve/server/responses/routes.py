"""The routes of OpenAI's Responses API: POST /v1/responses (served as a chat: convert.py, the whole answer;
events.py, the streamed one), and the stored responses (store.py): GET and DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.server.errors import APIError, fields_renamed
from nanoserve.server.responses.convert import RESPONSES_FIELDS, prepare_response, whole_response
from nanoserve.server.responses.events import response_events
from nanoserve.server.responses.schema import DeletedResponse, ResponsesRequest
from nanoserve.server.routing import Server, json_body, request_body, v1_router
from nanoserve.server.schema_base import now
from nanoserve.server.streaming import EventStreamResponse
from nanoserve.server.submit import add_requests, wait_for_outputs

router = v1_router()


@router.post("/responses", openapi_extra=request_body(ResponsesRequest))
async def create_response(request: Request, server: Server,
                          req: Annotated[ResponsesRequest, json_body(ResponsesRequest)]) -> Response:
    # large requests are rendered and tokenized in the server's thread pool, off the event loop (offload.py)
    prepared, chat, messages = await server.offload.run(await request.body(), prepare_response, server, req)
    response_id = req.request_id or f"resp_{uuid.uuid4().hex}"
    created_at = now()
    with fields_renamed(RESPONSES_FIELDS):
        streams = await add_requests(server, response_id, prepared, chat, "messages")
    if req.stream:
        return EventStreamResponse(response_events(server, req, prepared, response_id, created_at, streams[0],
                                                   messages), streams)
    with fields_renamed(RESPONSES_FIELDS):
        [output] = await wait_for_outputs(request, streams, chat, "messages")
    body = whole_response(server, req, prepared, response_id, created_at, output, messages)
    return JSONResponse(body.model_dump(mode="json"))


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str, server: Server, stream: bool = False) -> Response:
    stored = server.responses.get(response_id)
    if stream:  # vLLM replays a background response's events; this server runs none in the background
        raise APIError(400, "stream: only a response run in the background can be streamed again, and this server "
                            "runs none", param="stream")
    return JSONResponse(stored.response.model_dump(mode="json"))


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, server: Server) -> Response:
    server.responses.delete(response_id)
    return JSONResponse(DeletedResponse(id=response_id).model_dump())


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str, server: Server) -> Response:
    server.responses.get(response_id)  # 404 for an unknown one
    # only a background response can be cancelled (vLLM's rule); this server runs none, so a stored one has finished
    raise APIError(400, "response_id: cannot cancel a response that is not running in the background (this one "
                        "has finished)", param="response_id")
