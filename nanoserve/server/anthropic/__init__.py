"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens), served as a chat as vLLM serves
it (docs/anthropic_api.md).

    schema.py    the request, the message, the stream's events and the error body, as pydantic models
    convert.py   a request -> a chat request prepared for the engine; the answer -> the whole message
    events.py    the streamed answer: the Messages API's Server-Sent Events
    routes.py    the two routes
"""
