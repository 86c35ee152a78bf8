"""The HTTP routes, one router per route family; build_app (app.py) includes every router in its ROUTERS.

    common.py        what the routers share: the Server dependency, v1_router (/v1 + API key), json_body
    sagemaker.py     GET|POST /ping, POST /invocations (SageMaker)
    system.py        GET /health, GET /metrics, GET /version, GET /load, GET /v1/models

Each API's own routes live in its package (openai/routes.py, responses/routes.py, anthropic/routes.py). A new
route family is a router added to ROUTERS. Route functions stay thin: parse (json_body) -> convert (convert.py)
-> the engine (submit.py) -> respond (the API's bodies and events).
"""
