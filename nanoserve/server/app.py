"""build_app: the FastAPI app that serves an OpenAI-compatible API over an AsyncLLMEngine. This file only
assembles it (lifespan, exception handlers, routers, shared state); each concern has its own module.

Follow one POST /v1/chat/completions from the socket to the engine and back:

    uvicorn                   reads the HTTP request off the socket and calls the FastAPI app (ASGI)
    routes/common.py          check_api_key: 401 unless the Bearer token matches --api-key (when one is set);
                              json_body: bytes -> JSON -> ChatCompletionRequest (protocol/chat.py), a bad body
                              is a 400 naming the field (errors.py: describe_validation_error)
    routes/chat.py            the route: the steps below, in order
    convert.py                prepare_chat: the model name (404 if unknown), SamplingParams (400 if out of
                              range), the chat template renders the messages, the tokenizer turns the text into
                              ids, the length checks (400)
    submit.py                 add_requests: AsyncLLMEngine.add_request, queued on the engine (503 if the queue is
                              full) -> streams; wait_for_outputs: the finished outputs
    responses.py              non-streaming: the finished output as one JSON body (choices, usage, logprobs)
    streaming.py              streaming: a Server-Sent Events body, one chunk per engine step with the new text

If the client hangs up, the response is cancelled, which closes the request's stream, which aborts it in the
engine and frees its KV blocks. Every error leaves as OpenAI's {"error": {"message", "type", "param", "code"}}
(errors.py). The shared state - engine, tokenizer, model name, metrics, API key - is one OpenAIServer
(state.py) in `app.state.server`.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.server.errors import EXCEPTION_HANDLERS
from nanoserve.server.routes import ROUTERS
from nanoserve.server.state import ChatOptions, OpenAIServer

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              shutdown_timeout: float = 10.0, chat: ChatOptions | None = None) -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine loop and, on shutdown, drains and releases the engine.
    `chat`: tool calling, reasoning, chat template and generation-config options (ValueError naming the flag
    when one is unusable)."""
    server = OpenAIServer(engine, served_model_name, api_key=api_key, chat=chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        logger.info("serving `%s`", served_model_name)
        try:
            yield
        finally:
            logger.info("shutting down: draining in-flight requests (up to %.0f s)", shutdown_timeout)
            await engine.shutdown(drain_timeout=shutdown_timeout)

    app = FastAPI(title="nanoserve", summary="An OpenAI-compatible server for MiniMax M3", lifespan=lifespan,
                  exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = server
    for router in ROUTERS:
        app.include_router(router)
    return app
