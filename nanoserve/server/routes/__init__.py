"""The HTTP routes, one router per route family; build_app includes every router in ROUTERS.

    common.py        what the routers share: the Server dependency, v1_router (/v1 + API key), json_body
    completions.py   POST /v1/completions
    chat.py          POST /v1/chat/completions
    responses_api.py POST /v1/responses, GET|DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel
    system.py        GET /health, GET /metrics, GET /v1/models

Each API's own routes live in its package (anthropic/routes.py). A new route family is a new module here with a `router`, added to ROUTERS. Route functions stay thin: parse
(json_body) -> convert (convert.py) -> the engine (submit.py) -> respond (responses.py / streaming.py).
"""

from nanoserve.server.anthropic import routes as anthropic
from nanoserve.server.routes import chat, completions, responses_api, sagemaker, system, tokenize

ROUTERS = [completions.router, chat.router, responses_api.router, anthropic.router, tokenize.router, sagemaker.router,
           system.router]

__all__ = ["ROUTERS"]
