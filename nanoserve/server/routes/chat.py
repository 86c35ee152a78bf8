"""POST /v1/chat/completions: parse -> prepare (convert.py: the chat template, tokenize) -> the engine
(submit.py) -> one JSON body (responses.py) or an event stream (streaming.py)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.server.convert import prepare_chat
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.responses import chat_response
from nanoserve.server.routes.common import Server, json_body, request_body, v1_router
from nanoserve.server.state import OpenAIServer
from nanoserve.server.streaming import EventStreamResponse, chat_events
from nanoserve.server.submit import add_requests, wait_for_outputs

router = v1_router()


@router.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def create_chat_completion(request: Request, server: Server,
                                 req: Annotated[ChatCompletionRequest, json_body(ChatCompletionRequest)]
                                 ) -> Response:
    return await chat(request, server, req)


async def chat(request: Request, server: OpenAIServer, req: ChatCompletionRequest) -> Response:
    """A parsed chat request -> its response (also what POST /invocations runs for a chat body)."""
    # large requests are rendered and tokenized in the server's thread pool, off the event loop (offload.py)
    prepared = await server.offload.run(len(await request.body()), prepare_chat, server, req)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await add_requests(server, request_id, prepared, req, "messages")
    if req.stream:
        return EventStreamResponse(chat_events(server, request_id, req, prepared, streams[0]), streams)
    [output] = await wait_for_outputs(request, streams, req, "messages")
    return JSONResponse(chat_response(server, request_id, req, prepared, output).model_dump())
