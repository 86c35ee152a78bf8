"""The OpenAI-compatible HTTP server: `python -m nanoserve.server` (see __main__.py).

    app.py          build_app: assembles the app (lifespan, exception handlers, routers, shared state);
                    its docstring follows one request through the files below
    routes/         one router per route family: completions, chat, system (/health, /metrics, /v1/models)
    protocol/       request / response bodies (pydantic), one module per endpoint
    state.py        OpenAIServer: what the routes share (engine, tokenizer, model name, metrics, API key)
    convert.py      request -> prompts + SamplingParams: chat template, tokenize, length checks
    submit.py       prepared requests -> engine streams, and waiting for them (aborts on disconnect)
    responses.py    engine output -> response bodies: choices, usage, logprobs in the two OpenAI formats
    streaming.py    Server-Sent Events: the streaming bodies and the response that closes their streams
    errors.py       APIError, the mapping of pydantic / engine exceptions to HTTP errors, the exception handlers
    metrics.py      Prometheus metrics in vLLM's names

Only this package imports FastAPI, uvicorn and prometheus-client; the engine runs without them. `build_app` is
imported on first use, so that the body-parsing worker processes (parsing.py) load the request models alone.
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
