"""The routes of Anthropic's Messages API: POST /v1/messages (served as a chat: convert.py, the whole
answer; events.py, the streamed one) and POST /v1/messages/count_tokens. Errors on these routes take Anthropic's
shape (server/errors.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.server.anthropic.convert import (
    anthropic_fields,
    count_tokens,
    message_response,
    new_message_id,
    prepare_message,
)
from nanoserve.server.anthropic.events import message_events
from nanoserve.server.anthropic.schema import CountTokensRequest, MessagesRequest
from nanoserve.server.routing import Server, json_body, request_body, v1_router
from nanoserve.server.streaming import EventStreamResponse
from nanoserve.server.submit import add_requests, wait_for_outputs

router = v1_router()


@router.post("/messages", openapi_extra=request_body(MessagesRequest))
async def create_message(request: Request, server: Server,
                         req: Annotated[MessagesRequest, json_body(MessagesRequest)]) -> Response:
    # large requests are rendered and tokenized in the server's thread pool, off the event loop (offload.py)
    prepared, chat = await server.offload.run(await request.body(), prepare_message, server, req)
    message_id = new_message_id()
    with anthropic_fields():
        streams = await add_requests(server, message_id, prepared, chat, "messages")
    if req.stream:
        return EventStreamResponse(message_events(server, req, prepared, message_id, streams[0]), streams)
    with anthropic_fields():
        [output] = await wait_for_outputs(request, streams, chat, "messages")
    return JSONResponse(message_response(server, req, prepared, message_id, output).model_dump())


@router.post("/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
async def count_message_tokens(request: Request, server: Server,
                               req: Annotated[CountTokensRequest, json_body(CountTokensRequest)]) -> Response:
    result = await server.offload.run(await request.body(), count_tokens, server, req)
    return JSONResponse(result.model_dump())
