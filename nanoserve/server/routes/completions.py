"""POST /v1/completions: parse -> prepare (convert.py) -> the engine (submit.py) -> one JSON body
(responses.py) or an event stream (streaming.py)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.server.convert import prepare_completion
from nanoserve.server.protocol import CompletionRequest
from nanoserve.server.responses import completion_response
from nanoserve.server.routes.common import Server, json_body, request_body, v1_router
from nanoserve.server.state import OpenAIServer
from nanoserve.server.streaming import EventStreamResponse, completion_events
from nanoserve.server.submit import add_requests, wait_for_outputs

router = v1_router()


@router.post("/completions", openapi_extra=request_body(CompletionRequest))
async def create_completion(request: Request, server: Server,
                            req: Annotated[CompletionRequest, json_body(CompletionRequest)]) -> Response:
    return await complete(request, server, req)


async def complete(request: Request, server: OpenAIServer, req: CompletionRequest) -> Response:
    """A parsed completion request -> its response (also what POST /invocations runs for a completion body)."""
    # large requests are rendered and tokenized in the server's thread pool, off the event loop (offload.py)
    prepared = await server.offload.run(len(await request.body()), prepare_completion, server, req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await add_requests(server, request_id, prepared, req, "prompt")
    if req.stream:
        return EventStreamResponse(completion_events(server, request_id, req, prepared, streams), streams)
    outputs = await wait_for_outputs(request, streams, req, "prompt")
    return JSONResponse(completion_response(server, request_id, req, prepared, outputs).model_dump())
