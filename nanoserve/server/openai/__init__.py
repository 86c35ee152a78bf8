"""The OpenAI API: POST /v1/completions and POST /v1/chat/completions, and vLLM's POST /tokenize and
POST /detokenize beside them (docs/server_api.md). Its chat is what the other APIs are served as: a Responses or
Messages request becomes a ChatCompletionRequest (responses/, anthropic/).

    schema/      the request and response bodies, as pydantic models
    bodies.py    engine output -> the whole answer's body: choices, usage, logprobs in the two OpenAI formats
    events.py    engine output -> the streamed answer's Server-Sent Events
    routes.py    the routes

A request becomes engine input in server/prepare.py, shared by every API.
"""
