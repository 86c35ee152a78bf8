"""build_app: the FastAPI app that serves OpenAI's API, OpenAI's Responses API and Anthropic's Messages API over an
AsyncLLMEngine. This file only assembles it (lifespan, middleware, exception handlers, every API's routes, shared
state); each concern has its own module.

Follow one POST /v1/chat/completions from the socket to the engine and back:

    uvicorn                   reads the HTTP request off the socket and calls the FastAPI app (ASGI); a client
                              whose headers stall gets 408 (http_connection.py: --request-header-timeout)
    shutdown.py               LifecycleMiddleware: counts the request in flight; 503 while the server drains,
                              500 once the engine has died
    limits.py                 BodyLimitMiddleware: 413 for a body over --max-request-body-bytes, 408 for one
                              that stalls (--request-body-timeout)
    routing.py                check_api_key: 401 unless the Bearer token matches --api-key (when one is set);
                              json_body: bytes -> JSON -> ChatCompletionRequest (openai/schema/chat.py), a bad body
                              is a 400 naming the field (errors.py: describe_validation_error); a body of 1 MiB
                              or more is parsed in a worker process (body_parser.py), one of 64 KiB or more is
                              rendered and tokenized in a thread pool, off the event loop (offload.py)
    openai/routes.py          the route: the steps below, in order
    prepare.py                prepare_chat: the model name (404 if unknown), SamplingParams (400 if out of
                              range), the chat template renders the messages, the tokenizer turns the text into
                              ids, the length checks (400; the prompt count and characters before tokenizing:
                              limits.py)
    submit.py                 add_requests: AsyncLLMEngine.add_request, queued on the engine (503 if the queue is
                              full) -> streams; wait_for_outputs: the finished outputs
    openai/convert.py         non-streaming: the finished output as one JSON body (choices, usage, logprobs)
    openai/events.py          streaming: a Server-Sent Events body, one chunk per engine step with the new text
                              (streaming.py: EventStreamResponse closes the streams however it ends)

POST /v1/responses and POST /v1/messages take the same path: their convert.py (responses/, anthropic/) turns the
request into a chat request for prepare.py and the answer into that API's body; their events.py streams it.

If the client hangs up, the response is cancelled, which closes the request's stream, which aborts it in the
engine and frees its KV blocks. Every error leaves as OpenAI's {"error": {"message", "type", "param", "code"}}
(errors.py). The shared state - engine, tokenizer, model name, metrics, API key - is one ServerState
(state.py) in `app.state.server`.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.multimodal.loader import MediaRules
from nanoserve.server import sagemaker_routes, system_routes
from nanoserve.server.anthropic import routes as anthropic
from nanoserve.server.body_parser import DEFAULT_PARSE_PROCESSES, PARSE_PROCESS_MIN_BYTES, BodyParser
from nanoserve.server.errors import EXCEPTION_HANDLERS
from nanoserve.server.limits import BodyLimitMiddleware, ServerLimits
from nanoserve.server.offload import OFFLOAD_MIN_BYTES, Offloader
from nanoserve.server.openai import routes as openai
from nanoserve.server.responses import routes as responses
from nanoserve.server.responses.store import DEFAULT_STORE_SIZE
from nanoserve.server.shutdown import Lifecycle, LifecycleMiddleware
from nanoserve.server.state import ChatOptions, ServerState

logger = logging.getLogger(__name__)

ROUTERS = [openai.router, responses.router, anthropic.router, openai.tokenize_router, sagemaker_routes.router,
           system_routes.router]
"""Every API's routes, included in this order; GET /tokenizer_info (openai.tokenizer_info_router) only with
--enable-tokenizer-info-endpoint."""

LOAD_TRACKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/invocations")



class ServerLoadMiddleware:
    """Counts the generation requests in flight into ServerState.server_load (GET /load): from the request's
    arrival until its response - a whole event stream included - has been sent or abandoned."""

    def __init__(self, app, server: ServerState):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.server.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.server.server_load -= 1


def build_app(engine: AsyncLLMEngine, served_model_name: str | list[str], api_key: str | None = None,
              shutdown_timeout: float = 10.0, chat: ChatOptions | None = None, allowed_origins: list[str] = ("*",),
              allowed_methods: list[str] = ("*",), allowed_headers: list[str] = ("*",),
              allow_credentials: bool = False, enable_server_load_tracking: bool = False,
              limits: ServerLimits | None = None, offload_min_bytes: int = OFFLOAD_MIN_BYTES,
              parse_processes: int = DEFAULT_PARSE_PROCESSES,
              parse_process_min_bytes: int = PARSE_PROCESS_MIN_BYTES,
              responses_store_size: int = DEFAULT_STORE_SIZE, log_requests: int | None = None,
              enable_tokenizer_info_endpoint: bool = False, return_tokens_as_token_ids: bool = False,
              media_rules: MediaRules | None = None) -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine loop and, on shutdown, drains and releases the engine
    (GracefulServer in shutdown.py drains before uvicorn cancels anything; this is the fallback for other
    servers). `served_model_name`: the name clients send, or several (the first is the default and the metrics'
    label). `chat`: tool calling, reasoning, chat template and generation-config options (ValueError naming the
    flag when one is unusable). The CORS arguments are vLLM's --allowed-origins / --allowed-methods /
    --allowed-headers / --allow-credentials; `enable_server_load_tracking` makes GET /load count the requests
    in flight. `limits`: the per-request limits (limits.py); `offload_min_bytes`: from which body size a request
    is prepared off the event loop (offload.py); `parse_processes` / `parse_process_min_bytes`: how many worker
    processes parse bodies of at least that size (body_parser.py; 0 processes: every body in this process).
    `responses_store_size`: how many finished responses POST /v1/responses keeps (responses/store.py).
    `log_requests`: None, or log each generation request as it is queued with that many characters of its
    prompt (--enable-log-requests, --max-log-len). `enable_tokenizer_info_endpoint`: serve GET /tokenizer_info
    (vLLM's flag of that name: off by default, since it shows the chat template and the tokenizer's setup).
    `return_tokens_as_token_ids`: logprobs name tokens 'token_id:N' unless a request says otherwise.
    `media_rules`: which http(s) hosts and local paths an image or video URL may name, and the size a fetched file
    may have (--allowed-media-domains, --allowed-local-media-path, --max-media-bytes; default: data URLs only)."""
    offloader = Offloader(engine.get_tokenizer, min_bytes=offload_min_bytes)
    parser = BodyParser(offloader, processes=parse_processes, process_min_bytes=parse_process_min_bytes)
    server = ServerState(engine, served_model_name, api_key=api_key, chat=chat,
                          enable_server_load_tracking=enable_server_load_tracking, limits=limits,
                          offloader=offloader, parser=parser, responses_store_size=responses_store_size,
                          log_requests=log_requests, return_tokens_as_token_ids=return_tokens_as_token_ids,
                          media_rules=media_rules)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        logger.info("serving %s", ", ".join(f"`{n}`" for n in server.model_names))
        try:
            yield
        finally:
            logger.info("shutting down: draining in-flight requests (up to %.0f s)", shutdown_timeout)
            await engine.shutdown(drain_timeout=shutdown_timeout)
            server.parser.shutdown()
            server.offload.shutdown()

    app = FastAPI(title="nanoserve", summary="An OpenAI-compatible server for MiniMax M3", lifespan=lifespan,
                  exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = server
    app.state.lifecycle = server.lifecycle = Lifecycle(engine, shutdown_timeout)  # /health reads it too
    for router in ROUTERS:
        app.include_router(router)
    if enable_tokenizer_info_endpoint:
        app.include_router(openai.tokenizer_info_router)
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)
    if enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, server=server)
    app.add_middleware(BodyLimitMiddleware, limits=server.limits)
    app.add_middleware(LifecycleMiddleware, lifecycle=app.state.lifecycle)  # added last: the outer one
    return app
