"""The HTTP server: OpenAI's API (and vLLM's extensions of it), OpenAI's Responses API and Anthropic's Messages
API over one AsyncLLMEngine - `python -m nanoserve.server` (see __main__.py). One package per API; the plumbing
they share at this level.

Each API is a package with the same four files for the same four jobs:

    schema              the request and response bodies (pydantic), built on schema_base.py
    convert.py          request -> chat request (the Responses and Messages APIs, which are served as chats) and
                        engine output -> the whole answer's body
    events.py           engine output -> the streamed answer's Server-Sent Events
    routes.py           the routes

    openai/             POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize;
                        its schema/ is a package: chat.py, completions.py, sampling.py (what those two share),
                        tokenize.py, models.py
    responses/          POST /v1/responses and the stored responses (store.py), served as a chat
    anthropic/          POST /v1/messages, POST /v1/messages/count_tokens, served as a chat

What every API shares, in the order a request meets it (app.py's docstring follows one request through them):

    __main__.py         the CLI: vLLM's flags -> an engine and an app, served by uvicorn
    app.py              build_app: assembles the app (lifespan, middleware, exception handlers, ROUTERS)
    http_connection.py  uvicorn's HTTP parser (--http) with a deadline on each request's headers
    shutdown.py         the graceful drain on SIGTERM and the prompt exit when the engine dies
    limits.py           what a request may cost before the engine sees it: body size and time, prompt count, chars
    routing.py          what every route uses: the shared state as a dependency, the API key, json_body
    body_parser.py      request bytes -> request models; large bodies in worker processes
    offload.py          a thread pool that keeps large requests' work off the event loop
    schema_base.py      what every API's bodies build on: the strict request base, the response base, the error body
    state.py            ServerState: what the routes share (engine, tokenizers, model names, limits, metrics)
    prepare.py          request -> engine input: SamplingParams, chat template, tokenize, length checks
    submit.py           prepared requests -> engine streams, and waiting for them (aborts on disconnect)
    answer_blocks.py    a generated answer -> thinking, text and call blocks (the Responses and Messages APIs)
    streaming.py        Server-Sent Events: the pieces every event stream is built from, and the response
    errors.py           APIError, the mapping of pydantic / engine exceptions to HTTP errors, the handlers
    metrics.py          Prometheus metrics in vLLM's names
    system_routes.py    GET /health, /metrics, /version, /load, /v1/models
    sagemaker_routes.py GET|POST /ping, POST /invocations (SageMaker's routes)

Only this package imports FastAPI, uvicorn and prometheus-client; the engine runs without them. `build_app` is
imported on first use, and the API packages' __init__ files import nothing, so that the body-parsing worker
processes (body_parser.py) load the request models alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.server.app import build_app

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from nanoserve.server.app import build_app

        return build_app
    raise AttributeError(f"module 'nanoserve.server' has no attribute {name!r}")
