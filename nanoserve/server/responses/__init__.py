"""OpenAI's Responses API (POST /v1/responses, GET|DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel),
served as a chat (docs/responses_api.md).

    schema.py    the request with its input items, the response with its output items, the stream's events
    convert.py   a request -> a chat request prepared for the engine; the answer -> output items and the whole
                 response (OutputBuilder makes the items and their stream events alike)
    events.py    the streamed answer: the Responses API's Server-Sent Events
    store.py     the most recent finished responses (GET /v1/responses/{id}, previous_response_id)
    routes.py    the routes
"""
