"""The OpenAI-compatible HTTP server: `python -m nanoserve.server` (see __main__.py).

    protocol.py   request / response bodies (pydantic)
    app.py        the routes: completions, chat completions, models, health, metrics
    metrics.py    Prometheus metrics in vLLM's names

Only this package imports FastAPI, uvicorn and prometheus-client; the engine runs without them.
"""

from nanoserve.server.app import build_app

__all__ = ["build_app"]
